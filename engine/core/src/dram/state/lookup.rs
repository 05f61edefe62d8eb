//! The index seen from the tier: lookups by key, and the index kept in step with the slots
//! (index.rs holds slot ids only; the keys are read from the slots).

use kvnode_proto::{BlockKey, Digest};

use super::super::index::IndexKey;
use super::super::pool::{Resident, Slab, Slot, slot_parts};
use super::State;
use crate::policy::SlotId;

/// Slot `id` of `slabs`.
fn slot_in(slabs: &[Slab], id: SlotId) -> &Slot {
    let (slab, idx) = slot_parts(id);
    &slabs[slab as usize].slots[idx as usize]
}

/// The key of the indexed slot `id` (it holds a block: the index's invariant).
fn indexed_key(slabs: &[Slab], id: SlotId) -> IndexKey<'_> {
    match slot_in(slabs, id) {
        Slot::Block(r) => r.index_key(),
        _ => unreachable!("indexed slot {id:#x} holds no block"),
    }
}

impl State {
    /// The slot of the block `(digest, segment)` of namespace handle `ns`, if resident.
    pub(in crate::dram) fn find(&self, ns: u32, digest: &Digest, segment: u16) -> Option<SlotId> {
        let k = IndexKey {
            ns,
            digest,
            segment,
        };
        let slabs = &self.slabs;
        self.index.find(
            self.index.hash(k),
            |s| matches!(slot_in(slabs, s), Slot::Block(r) if r.is(k)),
        )
    }

    /// The slot of `key`, if resident.
    pub(in crate::dram) fn find_key(&self, key: &BlockKey) -> Option<SlotId> {
        self.find(self.handle_of(key.ns)?, &key.digest, key.segment)
    }

    /// The full key of a block.
    pub(in crate::dram) fn key_of(&self, r: &Resident) -> BlockKey {
        BlockKey {
            ns: self.namespaces[r.ns as usize].id,
            digest: r.digest,
            segment: r.segment,
        }
    }

    /// Indexes the block just written into `slot` (its key is not indexed yet).
    pub(in crate::dram) fn index_insert(&mut self, slot: SlotId) {
        let slabs = &self.slabs;
        self.index
            .insert(indexed_key(slabs, slot), slot, |s| indexed_key(slabs, s));
    }

    /// Takes `slot`, which held `r`, out of the index; whether it was there.
    pub(in crate::dram) fn index_remove(&mut self, slot: SlotId, r: &Resident) -> bool {
        let h = self.index.hash(r.index_key());
        self.index.remove(h, slot)
    }

    /// Takes the block still in `slot` out of the index; whether it was there.
    pub(in crate::dram) fn unindex(&mut self, slot: SlotId) -> bool {
        let h = self.index.hash(indexed_key(&self.slabs, slot));
        self.index.remove(h, slot)
    }

    /// Blocks indexed.
    pub(in crate::dram) fn indexed_len(&self) -> usize {
        self.index.len()
    }

    /// Every indexed block with its slot, in no particular order.
    pub(in crate::dram) fn indexed(&self) -> impl Iterator<Item = (SlotId, &Resident)> + '_ {
        self.index.slots().map(|s| match slot_in(&self.slabs, s) {
            Slot::Block(r) => (s, r),
            _ => unreachable!("indexed slot {s:#x} holds no block"),
        })
    }
}
