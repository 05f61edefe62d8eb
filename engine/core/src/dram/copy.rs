//! Copies of DRAM blocks to the lower tier that leave the block in DRAM: the stop-time flush
//! and write-behind (`spill.lag`, a target, not a bound).
//!
//! A copied block keeps its slot and stays readable: the copy holds one lease (never
//! evicted, reclaimed or reused meanwhile) and the `demoting` flag (no second copy and no
//! demotion picks it). When the write ends the block is marked `on_lower`, so a later
//! demotion moves it without writing it again.
//!
//! The write-behind queue lists committed blocks in commit order with their commit time
//! (and blocks whose copy or demotion failed, again); it is filled only while write-behind
//! is on (`write_behind`, or from a SIGTERM's copy while serving: `track_commits`), so
//! otherwise it stays empty.

use std::sync::Arc;
use std::time::Instant;

use kvnode_proto::BlockKey;

use super::pool::Slot;
use super::state::State;
use crate::policy::SlotId;
use crate::residency::RouterMeta;

/// A block picked to be copied down while it stays in DRAM.
#[derive(Debug, Clone)]
pub struct CopyDown {
    /// Slot holding the bytes.
    pub slot: SlotId,
    /// Block key.
    pub key: BlockKey,
    /// Arena byte offset of the bytes.
    pub offset: u64,
    /// Block length.
    pub len: u64,
}

/// Whether a block still needs a copy below: not moving, not deleted, and no copy there.
fn needs_copy(r: &super::pool::Resident, lower_has_it: bool) -> bool {
    !(r.demoting() || r.doomed || (r.on_lower() && lower_has_it))
}

impl State {
    /// Queues a freshly committed block for write-behind (when on).
    pub fn queue_write_behind(&mut self, slot: SlotId, key: BlockKey) {
        if self.write_behind.on {
            self.write_behind
                .queue
                .push_back((slot, key, Instant::now()));
        }
    }

    /// Marks the block in `slot` (if it still is `key`, uncopied and not moving) as being
    /// copied down and returns the copy.
    fn start_copy(&mut self, slot: SlotId, key: &BlockKey) -> Option<CopyDown> {
        let offset = self.offset(slot);
        let ns = self.handle_of(key.ns)?;
        let Slot::Block(r) = self.slot_mut(slot) else {
            return None;
        };
        let same = r.ns == ns && r.digest == key.digest && r.segment == key.segment;
        if !same || r.doomed || r.demoting() || r.on_lower() {
            return None;
        }
        r.leases += 1;
        r.set_demoting(true);
        let len = r.len;
        self.totals.leases += 1;
        Some(CopyDown {
            slot,
            key: *key,
            offset,
            len,
        })
    }

    /// Up to `max` blocks committed at or before `before` from the write-behind queue, oldest
    /// first. Entries whose block left DRAM or was already copied are dropped.
    pub fn pick_write_behind(&mut self, max: usize, before: Instant) -> Vec<CopyDown> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(&(slot, key, at)) = self.write_behind.queue.front() else {
                break;
            };
            if at > before {
                break;
            }
            self.write_behind.queue.pop_front();
            if self.find_key(&key) == Some(slot)
                && let Some(c) = self.start_copy(slot, &key)
            {
                out.push(c);
            }
        }
        out
    }

    /// Commit time of the oldest queued block not yet copied (an approximation: entries of
    /// blocks that left DRAM are dropped only when they reach the front).
    pub fn oldest_write_behind(&self) -> Option<Instant> {
        self.write_behind.queue.front().map(|e| e.2)
    }

    /// Up to `max` DRAM blocks with no copy below (`has_copy` says whether the lower tier
    /// holds a key), in no particular order (the stop-time flush).
    pub fn pick_uncopied(
        &mut self,
        max: usize,
        has_copy: &dyn Fn(&BlockKey) -> bool,
    ) -> Vec<CopyDown> {
        let cands: Vec<(SlotId, BlockKey)> = self
            .indexed()
            .map(|(s, r)| (s, r, self.key_of(r)))
            .filter(|(_, r, k)| needs_copy(r, has_copy(k)))
            .take(max)
            .map(|(s, _, k)| (s, k))
            .collect();
        let mut out = Vec::with_capacity(cands.len());
        for (slot, key) in cands {
            if let Slot::Block(r) = self.slot_mut(slot) {
                // A stale mark (the lower copy is gone): copy it again.
                r.set_on_lower(false);
            }
            if let Some(c) = self.start_copy(slot, &key) {
                out.push(c);
            }
        }
        out
    }

    /// Like [`State::pick_uncopied`] while the tier serves: walks the slots in arena order
    /// from `from`, looking at no more than `scan` slots (a bounded hold of the lock), and
    /// returns the picks with the slot to go on from (`None`: the walk reached the end).
    pub fn pick_uncopied_from(
        &mut self,
        from: SlotId,
        max: usize,
        scan: usize,
        has_copy: &dyn Fn(&BlockKey) -> bool,
    ) -> (Vec<CopyDown>, Option<SlotId>) {
        let (mut slab, mut idx) = super::pool::slot_parts(from);
        let mut cands = Vec::new();
        let mut seen = 0;
        let next = loop {
            let Some(s) = self.slabs.get(slab as usize) else {
                break None;
            };
            if idx as usize >= s.slots.len() {
                (slab, idx) = (slab + 1, 0);
                continue;
            }
            if cands.len() >= max || seen >= scan {
                break Some(super::pool::slot_id(slab, idx));
            }
            let id = super::pool::slot_id(slab, idx);
            if let Slot::Block(r) = &s.slots[idx as usize] {
                let k = self.key_of(r);
                if needs_copy(r, has_copy(&k)) {
                    cands.push((id, k));
                }
            }
            seen += 1;
            idx += 1;
        };
        let mut out = Vec::with_capacity(cands.len());
        for (slot, key) in cands {
            if self.find_key(&key) != Some(slot) {
                continue;
            }
            if let Slot::Block(r) = self.slot_mut(slot) {
                // A stale mark (the lower copy is gone): copy it again.
                r.set_on_lower(false);
            }
            if let Some(c) = self.start_copy(slot, &key) {
                out.push(c);
            }
        }
        (out, next)
    }

    /// Blocks with no copy below that no copy is under way for.
    pub fn count_uncopied(&self, has_copy: &dyn Fn(&BlockKey) -> bool) -> u64 {
        self.indexed()
            .filter(|(_, r)| needs_copy(r, has_copy(&self.key_of(r))))
            .count() as u64
    }

    /// Ends a copy: on success the block is marked as having a copy below and `on_lower`
    /// runs under the lock with its router metadata (to announce the lower tier's store).
    /// Returns `true` when the block was deleted meanwhile (drop the lower copy too).
    pub fn finish_copy(
        &mut self,
        c: &CopyDown,
        ok: bool,
        on_lower: impl FnOnce(Option<&Arc<RouterMeta>>),
    ) -> bool {
        let Slot::Block(r) = self.slot_mut(c.slot) else {
            unreachable!("a copied slot holds its block until the copy ends")
        };
        debug_assert!(r.demoting() && r.digest == c.key.digest && r.leases > 0);
        r.set_demoting(false);
        let doomed = r.doomed;
        if ok && !doomed {
            r.set_on_lower(true);
            on_lower(
                r.residency
                    .as_deref()
                    .map(crate::residency::Residency::meta),
            );
        }
        self.release(c.slot);
        if !ok && !doomed {
            // Copied again later (write-behind, the stop-time copy), not forgotten.
            self.queue_write_behind(c.slot, c.key);
        }
        doomed
    }

    /// Queues every block committed from now on for a copy down (the write-behind queue on,
    /// what is queued kept): the stop-time copy walks the blocks already here itself.
    pub fn track_commits(&mut self) {
        self.write_behind.on = true;
    }

    /// Blocks queued for a copy down.
    pub fn queued_copies(&self) -> usize {
        self.write_behind.queue.len()
    }
}
