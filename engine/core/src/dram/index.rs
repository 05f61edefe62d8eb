//! The DRAM tier's block index: a hash table of slot ids; the keys live in the slots.
//!
//! ```text
//!   (ns handle, digest, segment) ──hash──► table of SlotId (8 B + 1 control byte)
//!                                              │ compare: the key stored in the slot
//!                                              ▼
//!                                slabs[slab].slots[idx]: Resident { digest, segment, ns, .. }
//! ```
//!
//! A `HashMap<BlockKey, SlotId>` kept a second copy of every key (64 B with its 16-byte
//! namespace id, 80 B an entry): here an entry is the slot id alone, and a lookup compares
//! the key in the slot it points to. The table never reads a slot by itself: the caller
//! passes how to read one ([`IndexKey`] of a slot), for a lookup's compare and for the
//! re-hash when the table grows. Invariant: every slot id in the table holds a committed,
//! not doomed block whose key hashes to its entry (the tier inserts after writing the slot
//! and removes before freeing it).
//!
//! Hashing is keyed (std `RandomState`, SipHash): digests come from clients, and a client
//! that could pick colliding digests would slow every lookup.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;
use kvnode_proto::Digest;

use crate::policy::SlotId;

/// A key as the index sees it: the namespace by its handle, not its 16-byte id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexKey<'a> {
    /// Namespace handle.
    pub ns: u32,
    /// Page digest.
    pub digest: &'a Digest,
    /// Segment.
    pub segment: u16,
}

/// Slot ids by key.
#[derive(Debug, Default)]
pub struct Index {
    table: HashTable<SlotId>,
    hasher: std::hash::RandomState,
}

impl Index {
    /// The hash of `k` (keyed, per process).
    pub fn hash(&self, k: IndexKey<'_>) -> u64 {
        hash_with(&self.hasher, k)
    }

    /// The slot holding `k`, if any; `is_k` says whether a slot holds it.
    pub fn find(&self, hash: u64, mut is_k: impl FnMut(SlotId) -> bool) -> Option<SlotId> {
        self.table.find(hash, |&s| is_k(s)).copied()
    }

    /// Adds `slot`, which already holds its block (of key `k`, not present); `key_of` reads
    /// the key of a slot already in the table (for the re-hash when the table grows).
    pub fn insert<'k>(
        &mut self,
        k: IndexKey<'_>,
        slot: SlotId,
        key_of: impl Fn(SlotId) -> IndexKey<'k>,
    ) {
        let hasher = &self.hasher;
        self.table.insert_unique(hash_with(hasher, k), slot, |&s| {
            hash_with(hasher, key_of(s))
        });
    }

    /// Removes `slot`, whose block's key hashes to `hash`; whether it was there.
    pub fn remove(&mut self, hash: u64, slot: SlotId) -> bool {
        match self.table.find_entry(hash, |&s| s == slot) {
            Ok(e) => {
                e.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Every indexed slot, in no particular order.
    pub fn slots(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.table.iter().copied()
    }

    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.table.len()
    }
}

fn hash_with(hasher: &std::hash::RandomState, k: IndexKey<'_>) -> u64 {
    let mut h = hasher.build_hasher();
    for w in k.digest.0.chunks_exact(8) {
        h.write_u64(u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    h.write_u64((u64::from(k.ns) << 16) | u64::from(k.segment));
    h.finish()
}
