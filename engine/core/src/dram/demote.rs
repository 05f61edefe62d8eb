//! Demotion bookkeeping under the tier lock: picking victims ahead of need and ending their moves.
//!
//! A picked block keeps its slot and stays readable while its bytes are written to the
//! lower tier: the demotion holds one lease (so it is never evicted, reclaimed or reused)
//! and the block is out of the eviction policy. When the write ends the block leaves DRAM
//! (or goes back into the policy if the write failed).

use std::sync::Arc;

use kvnode_proto::BlockKey;

use super::pool::Slot;
use super::state::{State, key_hash};
use crate::policy::{BatchHint, EvictionPolicy, SlotId};
use crate::residency::RouterMeta;

/// A block picked for demotion; its slot is held until [`DemoteEnd`] is reported.
#[derive(Debug, Clone)]
pub struct Demotion {
    /// Slot holding the bytes.
    pub slot: SlotId,
    /// Block key.
    pub key: BlockKey,
    /// Arena byte offset of the bytes.
    pub offset: u64,
    /// Block length.
    pub len: u64,
    /// Slot bytes (the class size: a whole number of 4 KiB sectors).
    pub slot_bytes: u64,
    /// `get` hits while resident.
    pub reads: u32,
    /// A copy already exists below (the block was promoted from there).
    pub on_lower: bool,
}

/// How a demotion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoteEnd {
    /// The bytes are in the lower tier: the block leaves DRAM as a demotion.
    Moved,
    /// Not admitted to the lower tier: the block leaves DRAM as a plain eviction.
    Dropped,
    /// The write failed: the block stays in DRAM and becomes evictable again.
    Failed,
}

/// What `finish` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// The block left DRAM (or stayed, for `Failed`).
    Done,
    /// The block was deleted while its bytes were being written: drop the lower copy too.
    DeletedMeanwhile,
}

impl State {
    /// Free slot bytes: unassigned slabs plus free slots of every class.
    pub fn free_bytes(&self) -> u64 {
        let slabs = self.free_slabs.len() as u64 * self.slab_bytes;
        let slots: u64 = self
            .pools
            .iter()
            .map(|p| p.free.len() as u64 * p.slot_bytes)
            .sum();
        slabs + slots
    }

    /// Bytes the tier manages.
    pub fn capacity_bytes(&self) -> u64 {
        self.slabs.len() as u64 * self.slab_bytes
    }

    /// Picks up to `max` unleased blocks to demote while free bytes (counting demotions in
    /// flight) are below `high`. The class with most resident bytes gives first.
    pub fn pick_demotions(&mut self, max: usize, high: u64) -> Vec<Demotion> {
        self.expire_retention(std::time::Instant::now());
        let mut out = Vec::new();
        let mut exhausted = vec![false; self.pools.len()];
        while out.len() < max && self.free_bytes() + self.demoting_bytes < high {
            let Some(c) = (0..self.pools.len())
                .filter(|&c| !exhausted[c] && !self.pools[c].policy.is_empty())
                .max_by_key(|&c| self.pools[c].policy.len() as u64 * self.pools[c].slot_bytes)
            else {
                break;
            };
            let (slabs, held) = (&self.slabs, &self.retention);
            let victim = self.pools[c].policy.victim(&mut |s| {
                let (slab, idx) = super::pool::slot_parts(s);
                matches!(&slabs[slab as usize].slots[idx as usize], Slot::Block(r) if r.leases == 0)
                    && !held.holds(s)
            });
            let Some(slot) = victim else {
                exhausted[c] = true;
                continue;
            };
            out.push(self.begin_demotion(slot));
        }
        out
    }

    /// Takes the block in `slot` (resident, unleased, not held) out of the eviction policy
    /// and leases it for its move down.
    fn begin_demotion(&mut self, slot: SlotId) -> Demotion {
        let c = self.class_of(slot) as usize;
        let offset = self.offset(slot);
        let slot_bytes = self.pools[c].slot_bytes;
        let Slot::Block(r) = self.slot(slot) else {
            unreachable!("a demoted slot holds a block")
        };
        let key = self.key_of(r);
        let Slot::Block(r) = self.slot_mut(slot) else {
            unreachable!("a demoted slot holds a block")
        };
        r.leases += 1;
        r.set_demoting(true);
        let d = Demotion {
            slot,
            key,
            offset,
            len: r.len,
            slot_bytes,
            reads: u32::from(r.reads),
            on_lower: r.on_lower(),
        };
        self.demoting_bytes += slot_bytes;
        self.totals.in_flight += 1;
        d
    }

    /// Picks the named blocks for a demotion now (`kv.demote`): each resident, unleased block
    /// of `keys` leaves the eviction policy and its hold (an explicit demote ends a
    /// retention). Returns the picks and how many keys were skipped (absent, leased, or
    /// already moving).
    pub fn pick_keys(
        &mut self,
        ns: u32,
        keys: &[kvnode_proto::Key],
    ) -> Result<(Vec<Demotion>, u32), super::TierError> {
        self.ns(ns)?;
        let (mut out, mut skipped) = (Vec::new(), 0);
        for k in keys {
            let slot = self.find(ns, &k.0, k.1);
            let Some(slot) = slot.filter(|&s| {
                matches!(self.slot(s), Slot::Block(r) if r.leases == 0 && !r.doomed && !r.demoting())
            }) else {
                skipped += 1;
                continue;
            };
            self.unretain(slot);
            let c = self.class_of(slot) as usize;
            self.pools[c].policy.remove(slot);
            out.push(self.begin_demotion(slot));
        }
        Ok((out, skipped))
    }

    /// Ends a demotion. For `Moved`, `on_lower` runs (under the lock, before the DRAM
    /// residency ends) with the block's router metadata, so the lower tier's store is
    /// announced before the DRAM removal.
    pub fn finish_demotion(
        &mut self,
        d: &Demotion,
        end: DemoteEnd,
        on_lower: impl FnOnce(Option<&Arc<RouterMeta>>),
    ) -> Finished {
        self.demoting_bytes -= d.slot_bytes;
        self.totals.in_flight -= 1;
        let Slot::Block(r) = self.slot_mut(d.slot) else {
            unreachable!("a demoting slot holds its block until the demotion ends")
        };
        debug_assert!(r.demoting() && r.digest == d.key.digest && r.leases > 0);
        r.set_demoting(false);
        r.leases -= 1;
        let (leases, doomed, ns, len) = (r.leases, r.doomed, r.ns, r.len);
        let on_lower_now = r.on_lower();
        if doomed {
            if leases == 0 {
                self.free_slot(d.slot);
            }
            return Finished::DeletedMeanwhile;
        }
        if end == DemoteEnd::Failed {
            let c = self.class_of(d.slot) as usize;
            self.pools[c]
                .policy
                .insert(d.slot, key_hash(&d.key), BatchHint::SINGLE);
            if !on_lower_now {
                // Still without a copy below: a stop-time copy or write-behind takes it.
                self.queue_write_behind(d.slot, d.key);
            }
            return Finished::Done;
        }
        let residency = r.residency.take();
        if end == DemoteEnd::Moved {
            on_lower(residency.as_deref().map(crate::residency::Residency::meta));
            self.totals.demotions += 1;
        } else if self.has_lower && !d.on_lower {
            self.totals.dropped += 1;
        }
        drop(residency);
        self.unindex(d.slot);
        let c = self.class_of(d.slot) as usize;
        self.pools[c].evictions += 1;
        self.account_removed(d.slot, ns, len, true);
        if leases == 0 {
            self.free_slot(d.slot);
        } else if let Slot::Block(r) = self.slot_mut(d.slot) {
            // A reader still holds the bytes: free the slot at its release.
            r.doomed = true;
        }
        Finished::Done
    }
}
