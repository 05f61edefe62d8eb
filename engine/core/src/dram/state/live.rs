//! A takeover while this daemon keeps serving: the image is taken one slab at a time, the
//! slots changed meanwhile are noted, pre-copy rounds move the slots changed so far while
//! the donor still serves, and at the barrier (no request in flight) only the slots changed
//! since the last round travel, as a delta the successor applies to the tier it built.
//!
//! ```text
//!  donor (serving)                              successor (not serving yet)
//!  track(): dirty = {}
//!  image_slab(0..n), lock held per slab  ─────> restore(image): blocks of slots not
//!    (a slot already dirty is left out)           changed since track(), off the serving path
//!  ... serves; every slot_mut notes its slot ...
//!  delta_round(): dirty so far, taken   ─────> apply_round(); again until a round names
//!    (dirty = {} again), serving on               ≤ PRE_COPY.small slots (or max_rounds)
//!  barrier: drained, demoter stopped
//!  delta(): header + dirty slots + their  ─────> apply_delta(): slabs whose class changed
//!    blocks now (lock held, size ∝ churn          are emptied and re-cut, dirty slots
//!    during the last round)                       emptied, then the delta's blocks placed
//! ```
//!
//! Why it is exact: every change of what the image carries goes through `State::slot_mut`,
//! which notes the slot while tracking (leases and read counts, which the image does not
//! carry, change through `slot_counters_mut`, unnoted: reads do not grow the delta). A slot
//! left out of the image, or one whose content changed after its slab was copied, is dirty;
//! a round or the barrier carries its state at a time after its last change, and a later
//! round carries it again only if it changed again. A round is taken under one lock hold,
//! so its header (every slab's class, the holds) and its slots agree. Slab cuts
//! (`assign_slab`) replace slots without `slot_mut`, but only empty slots, and each delta
//! carries every slab's class: a slab re-cut since the last one is emptied and re-cut on
//! the successor, and a block put in it since is dirty, so it travels in that delta or a
//! later one. Delta format: magic `KVNDELT1`, u32 length + JSON header (`ImageHeader`,
//! every slab's class now, the holds now), u64 count + u64 dirty slots, u64 count + block
//! records as in the image.

use std::collections::HashSet;

use super::super::image::{ImageError, ImageHeader, Reader, assemble, bad, put_block, read_head};
use super::super::pool::{Slab, Slot, slot_parts};
use super::State;
use crate::policy::{EvictionPolicy, SlotId};

const DELTA_MAGIC: &[u8; 8] = b"KVNDELT1";

/// Free-list entries the barrier looks through per slot it fills (`unlist_near_the_top`).
const UNLIST_SCAN: usize = 4096;

/// When a takeover's pre-copy rounds stop: the successor, its tier built, asks for the
/// slots changed so far while the donor serves, applies them, and asks again, until a
/// round names at most `small` slots or `max_rounds` were taken. The barrier's delta is
/// then what changed during the last round (its transfer and apply), not during the
/// whole build: bounded by the request rate, not by the block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreCopy {
    /// Rounds at most (0: none, the barrier moves everything changed since the image).
    pub max_rounds: u32,
    /// A round naming at most this many slots is the last.
    pub small: u64,
}

/// The rounds a takeover takes: 8 at most (each ~10x smaller than the one before under a
/// steady put rate, since a round's slots take ~1 µs each to apply), stopping once one
/// names ≤ 256 slots (~0.3 ms to apply at the barrier).
pub const PRE_COPY: PreCopy = PreCopy {
    max_rounds: 8,
    small: 256,
};

/// What the pre-copy rounds did: the slots each named, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreCopyReport {
    /// Slots named by each round.
    pub rounds: Vec<u64>,
}

impl PreCopy {
    /// Runs rounds (`round` takes one delta from the donor, applies it and returns the
    /// slots it named) until one is small or `max_rounds` were taken.
    pub fn run<E>(&self, mut round: impl FnMut() -> Result<u64, E>) -> Result<PreCopyReport, E> {
        let mut report = PreCopyReport::default();
        while (report.rounds.len() as u32) < self.max_rounds {
            let slots = round()?;
            report.rounds.push(slots);
            if slots <= self.small {
                break;
            }
        }
        Ok(report)
    }
}

impl State {
    /// Starts noting changed slots (a live image begins).
    pub(in crate::dram) fn track(&mut self) {
        self.dirty = Some(HashSet::new());
    }

    /// Stops noting changed slots (the successor went away).
    pub(in crate::dram) fn untrack(&mut self) {
        self.dirty = None;
    }

    /// Appends the records of slab `slab`'s blocks that did not change since [`State::track`]
    /// to `out`; returns how many, and the slab's class.
    pub(in crate::dram) fn image_slab(&self, slab: u32, out: &mut Vec<u8>) -> (u64, Option<u32>) {
        let s = &self.slabs[slab as usize];
        let dirty = self.dirty.as_ref();
        let mut n = 0;
        for (i, slot) in s.slots.iter().enumerate() {
            let id = super::super::pool::slot_id(slab, i as u32);
            if let Slot::Block(r) = slot
                && !r.doomed
                && !dirty.is_some_and(|d| d.contains(&id))
            {
                put_block(out, id, self.namespaces[r.ns as usize].id, r);
                n += 1;
            }
        }
        (n, s.class)
    }

    /// The delta since [`State::track`] or the last [`State::delta_round`] (tracking
    /// ends). Refused while a slot is reserved or a block is being moved, like the image.
    pub(in crate::dram) fn delta(&mut self) -> Result<Vec<u8>, ImageError> {
        if self.totals.reserved > 0 || self.totals.in_flight > 0 {
            return Err(bad(format!(
                "{} slots reserved and {} demotions in flight: the tier is not quiescent",
                self.totals.reserved, self.totals.in_flight
            )));
        }
        let dirty = self
            .dirty
            .take()
            .ok_or_else(|| bad("no live image under way"))?;
        self.encode_delta(&dirty)
    }

    /// A pre-copy round, taken while serving: the slots changed since [`State::track`] or
    /// the last round, with their state now (a reserved slot travels as empty). Tracking
    /// goes on: a slot changed from now on travels in the next round or at the barrier.
    /// Returns the delta and the slots it names.
    pub(in crate::dram) fn delta_round(&mut self) -> Result<(Vec<u8>, u64), ImageError> {
        let dirty = std::mem::take(
            self.dirty
                .as_mut()
                .ok_or_else(|| bad("no live image under way"))?,
        );
        Ok((self.encode_delta(&dirty)?, dirty.len() as u64))
    }

    /// Header (every slab's class now, the holds now) + `dirty` + their blocks now.
    fn encode_delta(&self, dirty: &HashSet<SlotId>) -> Result<Vec<u8>, ImageError> {
        let header = self.header(self.slabs.iter().map(|s| s.class).collect());
        let mut body = Vec::with_capacity(8 + dirty.len() * 104);
        body.extend_from_slice(&(dirty.len() as u64).to_le_bytes());
        let mut blocks = Vec::new();
        let mut n = 0u64;
        for &slot in dirty {
            body.extend_from_slice(&slot.to_le_bytes());
            if let Slot::Block(r) = self.slot(slot)
                && !r.doomed
            {
                put_block(&mut blocks, slot, self.namespaces[r.ns as usize].id, r);
                n += 1;
            }
        }
        body.extend_from_slice(&n.to_le_bytes());
        body.extend_from_slice(&blocks);
        assemble(*DELTA_MAGIC, &header, 0, &body)
    }

    /// Applies a [`State::delta`] or [`State::delta_round`] to a tier restored from the live
    /// image. Refused (the tier is then unusable) when the delta does not fit it. Returns
    /// the dirty slots. With `filter_free` (a round, off the serving path) the free lists
    /// lose the slots that took a block in one pass over them; without (the barrier, where
    /// a pass over every free slot would grow with the tier) those slots stay listed and
    /// are skipped when popped (`State::pop_free`).
    pub(in crate::dram) fn apply_delta(
        &mut self,
        delta: &[u8],
        filter_free: bool,
    ) -> Result<u64, ImageError> {
        let mut r = Reader { b: delta };
        let header = read_head(&mut r, *DELTA_MAGIC)?;
        if r.u64()? != 0 {
            return Err(bad("malformed delta"));
        }
        self.follow_header(&header)?;
        let dirty = r.u64()?;
        if dirty > (r.b.len() / 8) as u64 {
            return Err(bad("delta truncated"));
        }
        for _ in 0..dirty {
            let slot = r.u64()?;
            self.empty_slot(slot)?;
        }
        let n = r.u64()?;
        let mut placed = Vec::new();
        for _ in 0..n {
            let slot =
                r.b.get(..8)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
            self.restore_block(&mut r)?;
            placed.push(slot);
        }
        if !r.b.is_empty() {
            return Err(bad("trailing bytes after the delta's last block"));
        }
        if filter_free {
            self.filter_free(&placed);
        } else {
            self.unlist_near_the_top(&placed);
        }
        for (slot, _) in self.retention.ends() {
            self.unretain(slot);
        }
        self.restore_holds(&header.retained);
        Ok(dirty)
    }

    /// Takes the slots that took a block off the free lists in one pass over them (a
    /// round's), with one bit per slot of each slab that took a block (a hash lookup per
    /// free slot cost ~20 ns over every free slot).
    fn filter_free(&mut self, placed: &[SlotId]) {
        if placed.is_empty() {
            return;
        }
        let mut bits: Vec<Vec<u64>> = vec![Vec::new(); self.slabs.len()];
        for &slot in placed {
            let (slab, idx) = slot_parts(slot);
            let b = &mut bits[slab as usize];
            if b.is_empty() {
                b.resize(self.slabs[slab as usize].slots.len().div_ceil(64), 0);
            }
            b[idx as usize / 64] |= 1 << (idx % 64);
        }
        for p in &mut self.pools {
            p.free.retain(|&s| {
                let (slab, idx) = slot_parts(s);
                bits[slab as usize]
                    .get(idx as usize / 64)
                    .is_none_or(|w| w >> (idx % 64) & 1 == 0)
            });
        }
    }

    /// The barrier's way (bounded, whatever the tier's size): each slot that took a block
    /// is looked for among the last [`UNLIST_SCAN`] entries of its free list (where the
    /// donor's next slots usually are: both lists hand out the lowest free slot first) and
    /// removed there; one not found stays listed and is dropped when popped
    /// ([`State::pop_free`]), counting as free in `free_bytes` until then.
    fn unlist_near_the_top(&mut self, placed: &[SlotId]) {
        for &slot in placed {
            let c = self.class_of(slot) as usize;
            let free = &mut self.pools[c].free;
            let lo = free.len().saturating_sub(UNLIST_SCAN);
            if let Some(i) = free[lo..].iter().rposition(|&s| s == slot) {
                free.remove(lo + i);
            }
        }
    }

    /// The next free slot of class `c`. A barrier's delta leaves the slots it filled on
    /// the free lists (`apply_delta` without `filter_free`): such a slot is dropped here.
    pub(in crate::dram) fn pop_free(&mut self, c: usize) -> Option<SlotId> {
        while let Some(s) = self.pools[c].free.pop() {
            if matches!(self.slot(s), Slot::Free) {
                return Some(s);
            }
        }
        None
    }

    /// Registers the namespaces added since the image and re-cuts the slabs whose class
    /// changed.
    fn follow_header(&mut self, header: &ImageHeader) -> Result<(), ImageError> {
        let known = self.namespaces.len();
        let same = header.namespaces.len() >= known
            && self
                .namespaces
                .iter()
                .zip(&header.namespaces)
                .all(|(n, spec)| n.spec == *spec);
        if !same || header.slab_class.len() != self.slabs.len() {
            return Err(bad(
                "the delta's namespaces or slabs differ from the image's",
            ));
        }
        for spec in &header.namespaces[known..] {
            self.register(spec)
                .map_err(|e| bad(format!("namespace {}: {e}", spec.model)))?;
        }
        let classes: Vec<u64> = self.pools.iter().map(|p| p.slot_bytes).collect();
        if classes != header.classes {
            return Err(bad("slot classes differ from the delta's"));
        }
        for (i, &want) in header.slab_class.iter().enumerate() {
            if self.slabs[i].class != want {
                self.recut(i as u32, want)?;
            }
        }
        Ok(())
    }

    /// Empties slab `slab` and gives it to class `want` (or leaves it unassigned).
    fn recut(&mut self, slab: u32, want: Option<u32>) -> Result<(), ImageError> {
        if want.is_some_and(|c| c as usize >= self.pools.len()) {
            return Err(bad(format!("slab {slab} of unknown class {want:?}")));
        }
        for i in 0..self.slabs[slab as usize].slots.len() as u32 {
            self.empty_slot(super::super::pool::slot_id(slab, i))?;
        }
        match self.slabs[slab as usize].class {
            Some(c) => {
                let pool = &mut self.pools[c as usize];
                pool.free.retain(|&s| slot_parts(s).0 != slab);
                pool.slabs.retain(|&s| s != slab);
                self.empty_slabs.remove(&slab);
                self.slabs[slab as usize] = Slab::default();
            }
            None => self.free_slabs.retain(|&s| s != slab),
        }
        match want {
            Some(c) => self.assign_slab(slab, c),
            None => self.free_slabs.push(slab),
        }
        Ok(())
    }

    /// Removes the block in `slot`, if any, as if it had never been restored (no removal is
    /// counted: the donor counted it), and puts the slot on its free list.
    fn empty_slot(&mut self, slot: SlotId) -> Result<(), ImageError> {
        let (slab, idx) = slot_parts(slot);
        let Some(s) = self.slabs.get_mut(slab as usize) else {
            return Err(bad(format!("slot {slot:#x} outside the tier")));
        };
        // Beyond its slab's slots (re-cut since): nothing to empty.
        let Some(s) = s.slots.get_mut(idx as usize) else {
            return Ok(());
        };
        let Slot::Block(r) = std::mem::replace(s, Slot::Free) else {
            return Ok(());
        };
        let class = self.class_of(slot);
        self.pools[class as usize].policy.remove(slot);
        self.index_remove(slot, &r);
        self.unretain(slot);
        self.totals.blocks -= 1;
        self.totals.bytes -= r.len;
        let st = self.ns_stats_mut(r.ns);
        st.blocks -= 1;
        st.bytes -= r.len;
        self.mark_free(slot);
        self.pools[class as usize].free.push(slot);
        Ok(())
    }
}
