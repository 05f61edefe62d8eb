//! Slabs and slot classes: how the arena is carved into fixed-size slots.
//!
//! The arena is cut into equal slabs. A slot class (pool) owns whole slabs and cuts each
//! into slots of its size, so pages of different sizes never share a slot and waste is
//! bounded by the 4 KiB rounding of the class size plus one slab's tail per class.

use kvnode_proto::{BlockKey, Digest};

use super::index::IndexKey;
use crate::policy::{Policy, PolicyKind, SlotId};
use crate::residency::Residency;

/// Slot sizes are rounded up to this (O_DIRECT alignment for the spill tier).
pub const SLOT_ALIGN: u64 = 4096;

/// What a slot holds: 72 bytes (the enum's tag sits in a `bool`'s spare values). One per
/// slot of every assigned slab, so this is most of the tier's heap per block (docs/architecture.md,
/// "DRAM index").
#[derive(Debug)]
pub enum Slot {
    /// Available.
    Free,
    /// Being written by connection `conn` (not visible to readers).
    Reserved {
        /// Owning connection.
        conn: u64,
    },
    /// A committed, immutable block.
    Block(Resident),
}

/// A committed block. Its key is `(namespaces[ns].id, digest, segment)`: the namespace by its
/// handle (4 bytes, not the 16-byte id), and the index keeps no copy of the key (index.rs).
#[derive(Debug)]
pub struct Resident {
    /// Page digest.
    pub digest: Digest,
    /// Bytes used in the slot.
    pub len: u64,
    /// Fingerprint of the bytes (first 8 bytes of their BLAKE3 hash) when `FINGERPRINT` is
    /// set: once someone computed it (peer sends, verified pulls).
    fingerprint: u64,
    /// The block's KV-event residency in DRAM (boxed: only with events); dropping it
    /// announces the removal.
    pub residency: Option<Box<Residency>>,
    /// Namespace handle.
    pub ns: u32,
    /// Outstanding leases; while non-zero the slot is never evicted or reused.
    pub leases: u32,
    /// `get` hits so far, saturating (admission policy `second-read` asks for 2).
    pub reads: u16,
    /// Segment of the page.
    pub segment: u16,
    /// Removed from the index while leased: freed when the last lease ends.
    pub doomed: bool,
    /// `DEMOTING`, `ON_LOWER`, `FINGERPRINT`.
    flags: u8,
}

/// Being written to the next tier; holds one of `leases` until the write ends.
const DEMOTING: u8 = 1;
/// A copy exists in the next tier (the block was promoted from it, or copied down).
const ON_LOWER: u8 = 2;
/// `fingerprint` holds one.
const FINGERPRINT: u8 = 4;

impl Resident {
    /// A block just committed (or restored) with `len` bytes in the slot.
    pub fn new(ns: u32, digest: Digest, segment: u16, len: u64) -> Self {
        Self {
            digest,
            len,
            fingerprint: 0,
            residency: None,
            ns,
            leases: 0,
            reads: 0,
            segment,
            doomed: false,
            flags: 0,
        }
    }

    /// Whether this is the block of `k`.
    pub fn is(&self, k: IndexKey<'_>) -> bool {
        self.digest == *k.digest && self.segment == k.segment && self.ns == k.ns
    }

    /// Its key as the index sees it.
    pub fn index_key(&self) -> IndexKey<'_> {
        IndexKey {
            ns: self.ns,
            digest: &self.digest,
            segment: self.segment,
        }
    }

    fn set(&mut self, flag: u8, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }

    /// Being written to the next tier; holds one of `leases` until the write ends.
    pub fn demoting(&self) -> bool {
        self.flags & DEMOTING != 0
    }

    /// Sets [`Resident::demoting`].
    pub fn set_demoting(&mut self, on: bool) {
        self.set(DEMOTING, on);
    }

    /// A copy exists in the next tier.
    pub fn on_lower(&self) -> bool {
        self.flags & ON_LOWER != 0
    }

    /// Sets [`Resident::on_lower`].
    pub fn set_on_lower(&mut self, on: bool) {
        self.set(ON_LOWER, on);
    }

    /// The fingerprint of the bytes, once someone computed it.
    pub fn fingerprint(&self) -> Option<u64> {
        (self.flags & FINGERPRINT != 0).then_some(self.fingerprint)
    }

    /// Records the fingerprint of the bytes.
    pub fn set_fingerprint(&mut self, fingerprint: u64) {
        self.fingerprint = fingerprint;
        self.flags |= FINGERPRINT;
    }

    /// Counts a `get` hit.
    pub fn count_read(&mut self) {
        self.reads = self.reads.saturating_add(1);
    }
}

const _: () = assert!(
    size_of::<Slot>() == 72,
    "a slot grew: see docs/architecture.md"
);

/// Committed blocks not yet copied down, oldest first (write-behind only).
#[derive(Debug, Default)]
pub struct WriteBehind {
    /// Whether commits are queued.
    pub on: bool,
    /// (slot, key, commit time), in commit order.
    pub queue: std::collections::VecDeque<(SlotId, BlockKey, std::time::Instant)>,
}

/// A slab: unassigned, or cut into slots of one class.
#[derive(Debug, Default)]
pub struct Slab {
    /// Owning class.
    pub class: Option<u32>,
    /// Slots (empty when unassigned).
    pub slots: Vec<Slot>,
    /// Slots not `Free` (reserved or holding a block).
    pub used: u32,
}

/// One slot class.
#[derive(Debug)]
pub struct Pool {
    /// Class index.
    pub class: u32,
    /// Slot size (multiple of [`SLOT_ALIGN`]).
    pub slot_bytes: u64,
    /// Owned slabs.
    pub slabs: Vec<u32>,
    /// Free slots of owned slabs.
    pub free: Vec<SlotId>,
    /// Eviction order of committed, unleased-or-leased blocks.
    pub policy: Policy,
    /// Evictions from this class.
    pub evictions: u64,
    /// Slots of this class in `Reserved` state (so `stats` need not walk the slots).
    pub reserved: u64,
}

impl Pool {
    /// An empty class.
    pub fn new(class: u32, slot_bytes: u64, kind: PolicyKind) -> Self {
        Self {
            class,
            slot_bytes,
            slabs: Vec::new(),
            free: Vec::new(),
            policy: Policy::new(kind),
            reserved: 0,
            evictions: 0,
        }
    }
}

/// Packs a slot id.
pub fn slot_id(slab: u32, idx: u32) -> SlotId {
    (u64::from(slab) << 32) | u64::from(idx)
}

/// Unpacks a slot id.
pub fn slot_parts(id: SlotId) -> (u32, u32) {
    ((id >> 32) as u32, id as u32)
}

/// Rounds a declared slot size up to the class size; saturates instead of wrapping, so a
/// size near `u64::MAX` can only be refused as larger than a slab, never become 0.
pub fn class_bytes(declared: u64) -> u64 {
    declared.div_ceil(SLOT_ALIGN).saturating_mul(SLOT_ALIGN)
}

#[cfg(test)]
mod tests {
    #[test]
    fn class_bytes_never_wraps_to_a_small_class() {
        assert_eq!(super::class_bytes(1), 4096);
        assert_eq!(super::class_bytes(4096), 4096);
        assert_eq!(super::class_bytes(u64::MAX), u64::MAX);
        assert!(super::class_bytes(u64::MAX - 4095) >= u64::MAX - 4095);
    }
}
