//! Slabs and slot classes: how the arena is carved into fixed-size slots.
//!
//! The arena is cut into equal slabs. A slot class (pool) owns whole slabs and cuts each
//! into slots of its size, so pages of different sizes never share a slot and waste is
//! bounded by the 4 KiB rounding of the class size plus one slab's tail per class.

use kvnode_proto::BlockKey;

use crate::policy::{Policy, PolicyKind, SlotId};
use crate::residency::Residency;

/// Slot sizes are rounded up to this (O_DIRECT alignment for the spill tier).
pub const SLOT_ALIGN: u64 = 4096;

/// What a slot holds.
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

/// A committed block.
#[derive(Debug)]
pub struct Resident {
    /// Key.
    pub key: BlockKey,
    /// Namespace handle.
    pub ns: u32,
    /// Bytes used in the slot.
    pub len: u64,
    /// Outstanding leases; while non-zero the slot is never evicted or reused.
    pub leases: u32,
    /// Removed from the index while leased: freed when the last lease ends.
    pub doomed: bool,
    /// Being written to the next tier; holds one of `leases` until the write ends.
    pub demoting: bool,
    /// A copy exists in the next tier (the block was promoted from it).
    pub on_lower: bool,
    /// `get` hits so far (admission policy `second-read`).
    pub reads: u32,
    /// The block's KV-event residency in DRAM; dropping it announces the removal.
    pub residency: Option<Residency>,
    /// Fingerprint of the bytes (first 8 bytes of their BLAKE3 hash), once someone computed it
    /// (peer sends, verified pulls).
    pub fingerprint: Option<u64>,
}

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
