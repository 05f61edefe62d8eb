//! A takeover while this daemon keeps serving: the image is taken one slab at a time, the
//! slots changed meanwhile are noted, and at the barrier (no request in flight) only those
//! slots travel, as a delta the successor applies to the tier it built from the image.
//!
//! ```text
//!  donor (serving)                              successor (not serving yet)
//!  track(): dirty = {}                          
//!  image_slab(0..n), lock held per slab  ─────> restore(image): blocks of slots not
//!    (a slot already dirty is left out)           changed since track(), off the serving path
//!  ... serves; every slot_mut notes its slot ...
//!  barrier: drained, demoter stopped
//!  delta(): header + dirty slots + their  ─────> apply_delta(): slabs whose class changed
//!    blocks now (lock held, size ∝ churn)         are emptied and re-cut, dirty slots
//!                                                 emptied, then the delta's blocks placed
//! ```
//!
//! Why it is exact: every change of what the image carries goes through `State::slot_mut`,
//! which notes the slot while tracking (leases and read counts, which the image does not
//! carry, change through `slot_counters_mut`, unnoted: reads do not grow the delta). A slot left out of the image, or one whose content changed after its
//! slab was copied, is dirty, and the delta carries its state at the barrier; a slot that is
//! not dirty holds at the barrier what the image says. Slab cuts (`assign_slab`) replace
//! slots without `slot_mut`, but only empty slots, and the delta carries every slab's class.
//! Delta format: magic `KVNDELT1`, u32 length + JSON header (`ImageHeader`, every slab's
//! class now, the holds now), u64 count + u64 dirty slots, u64 count + block records as in
//! the image.

use std::collections::HashSet;

use super::super::image::{ImageError, ImageHeader, Reader, assemble, bad, put_block, read_head};
use super::super::pool::{Slab, Slot, slot_parts};
use super::State;
use crate::policy::{EvictionPolicy, SlotId};

const DELTA_MAGIC: &[u8; 8] = b"KVNDELT1";

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

    /// The delta since [`State::track`] (tracking ends). Refused while a slot is reserved or
    /// a block is being moved, like the image.
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
        let header = self.header(self.slabs.iter().map(|s| s.class).collect());
        let mut body = Vec::with_capacity(8 + dirty.len() * 104);
        body.extend_from_slice(&(dirty.len() as u64).to_le_bytes());
        let mut blocks = Vec::new();
        let mut n = 0u64;
        for &slot in &dirty {
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

    /// Applies a [`State::delta`] to a tier restored from the live image. Refused (the tier
    /// is then unusable) when the delta does not fit it. Returns the dirty slots.
    pub(in crate::dram) fn apply_delta(&mut self, delta: &[u8]) -> Result<u64, ImageError> {
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
        // One bit per slot of each slab that took a block: the free lists are filtered
        // with it in one pass (a hash lookup per free slot cost ~20 ns over every free slot).
        let mut placed: Vec<Vec<u64>> = vec![Vec::new(); self.slabs.len()];
        for _ in 0..n {
            let slot =
                r.b.get(..8)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
            self.restore_block(&mut r)?;
            let (slab, idx) = slot_parts(slot);
            let bits = &mut placed[slab as usize];
            if bits.is_empty() {
                bits.resize(self.slabs[slab as usize].slots.len().div_ceil(64), 0);
            }
            bits[idx as usize / 64] |= 1 << (idx % 64);
        }
        if !r.b.is_empty() {
            return Err(bad("trailing bytes after the delta's last block"));
        }
        if n > 0 {
            for p in &mut self.pools {
                p.free.retain(|&s| {
                    let (slab, idx) = slot_parts(s);
                    placed[slab as usize]
                        .get(idx as usize / 64)
                        .is_none_or(|w| w >> (idx % 64) & 1 == 0)
                });
            }
        }
        for (slot, _) in self.retention.ends() {
            self.unretain(slot);
        }
        self.restore_holds(&header.retained);
        Ok(dirty)
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
