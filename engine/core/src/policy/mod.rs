//! Eviction policies: which resident slot of a pool to give up next.
//!
//! Policies see slot ids, key hashes and each block's place in its batch ([`BatchHint`]); the
//! tier decides what is evictable (a leased slot never is) and passes that in as a predicate.
//! Dispatch is an enum: the tier calls the policy on every insert, hit and eviction, under its
//! lock.

mod chain;
mod lru;
mod s3fifo;
mod slots;

pub use chain::Chain;
pub use lru::Lru;
pub use s3fifo::S3Fifo;

use serde::{Deserialize, Serialize};

/// A slot id as the tier numbers them (`slab << 32 | index`).
pub type SlotId = u64;

/// Where a block stands in the batch that inserted or read it. A put and a lookup carry one
/// request's pages in prefix order, so page `depth` is the child of page `depth - 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHint {
    /// Position in the batch (0: its first page).
    pub depth: u32,
    /// Pages in the batch.
    pub len: u32,
}

impl BatchHint {
    /// A block on its own (a failed demotion put back, a restored index).
    pub const SINGLE: BatchHint = BatchHint { depth: 0, len: 1 };

    /// Page `index` of a batch of `len` pages (saturating at `u32::MAX`).
    pub fn at(index: usize, len: usize) -> Self {
        Self {
            depth: u32::try_from(index).unwrap_or(u32::MAX),
            len: u32::try_from(len).unwrap_or(u32::MAX),
        }
    }
}

/// The operations a policy supports.
pub trait EvictionPolicy {
    /// A block became resident in `slot`; `key_hash` identifies the block across slot reuse.
    fn insert(&mut self, slot: SlotId, key_hash: u64, hint: BatchHint);
    /// The block in `slot` was read.
    fn touch(&mut self, slot: SlotId, hint: BatchHint);
    /// The block in `slot` left for another reason (delete, clear, slab reclaim).
    fn remove(&mut self, slot: SlotId);
    /// Picks and forgets a victim for which `evictable` is true; `None` when there is none.
    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId>;
    /// Slots tracked.
    fn len(&self) -> usize;
    /// Whether no slot is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which policy a tier uses (config `eviction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Least recently used (default).
    #[default]
    Lru,
    /// S3-FIFO: scan-resistant; one-hit blocks leave through a small FIFO.
    S3fifo,
    /// Made for prefix-chained KV blocks: recency plus remembered reuse (ghosts), a chain cut
    /// from its tail (docs/eviction.md).
    Chain,
}

/// Enum dispatch over the policies.
#[derive(Debug)]
pub enum Policy {
    /// LRU.
    Lru(Lru),
    /// S3-FIFO.
    S3Fifo(S3Fifo),
    /// Chain-aware.
    Chain(Chain),
}

impl Policy {
    /// A fresh policy of `kind`.
    pub fn new(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::Lru => Policy::Lru(Lru::default()),
            PolicyKind::S3fifo => Policy::S3Fifo(S3Fifo::default()),
            PolicyKind::Chain => Policy::Chain(Chain::default()),
        }
    }
}

impl EvictionPolicy for Policy {
    fn insert(&mut self, slot: SlotId, key_hash: u64, hint: BatchHint) {
        match self {
            Policy::Lru(p) => p.insert(slot, key_hash, hint),
            Policy::S3Fifo(p) => p.insert(slot, key_hash, hint),
            Policy::Chain(p) => p.insert(slot, key_hash, hint),
        }
    }
    fn touch(&mut self, slot: SlotId, hint: BatchHint) {
        match self {
            Policy::Lru(p) => p.touch(slot, hint),
            Policy::S3Fifo(p) => p.touch(slot, hint),
            Policy::Chain(p) => p.touch(slot, hint),
        }
    }
    fn remove(&mut self, slot: SlotId) {
        match self {
            Policy::Lru(p) => p.remove(slot),
            Policy::S3Fifo(p) => p.remove(slot),
            Policy::Chain(p) => p.remove(slot),
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        match self {
            Policy::Lru(p) => p.victim(evictable),
            Policy::S3Fifo(p) => p.victim(evictable),
            Policy::Chain(p) => p.victim(evictable),
        }
    }
    fn len(&self) -> usize {
        match self {
            Policy::Lru(p) => p.len(),
            Policy::S3Fifo(p) => p.len(),
            Policy::Chain(p) => p.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        /// Against a model set: a victim is always tracked and evictable, and once every
        /// tracked slot is evictable a victim always exists.
        #[test]
        fn policies_only_evict_tracked_evictable_slots(
            kind in prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::S3fifo), Just(PolicyKind::Chain)],
            ops in proptest::collection::vec((0u8..4, 0u64..32, 0u32..4), 1..400),
        ) {
            let mut p = Policy::new(kind);
            let mut live: HashSet<SlotId> = HashSet::new();
            for (op, slot, depth) in ops {
                let hint = BatchHint { depth, len: 4 };
                match op {
                    0 => if live.insert(slot) { p.insert(slot, slot * 7919, hint) },
                    1 => if live.contains(&slot) { p.touch(slot, hint) },
                    2 => if live.remove(&slot) { p.remove(slot) },
                    _ => {
                        // odd slots are "leased"
                        let v = p.victim(&mut |s| s % 2 == 0);
                        if let Some(v) = v {
                            prop_assert!(v % 2 == 0);
                            prop_assert!(live.remove(&v));
                        } else {
                            prop_assert!(live.iter().all(|s| s % 2 == 1));
                        }
                    }
                }
                prop_assert_eq!(p.len(), live.len());
            }
        }
    }

    #[test]
    fn lru_evicts_least_recently_touched() {
        let mut p = Policy::new(PolicyKind::Lru);
        for s in 0..4 {
            p.insert(s, s, BatchHint::SINGLE);
        }
        p.touch(0, BatchHint::SINGLE);
        assert_eq!(p.victim(&mut |_| true), Some(1));
        assert_eq!(p.victim(&mut |s| s != 2), Some(3));
        assert_eq!(p.victim(&mut |_| true), Some(2));
    }

    #[test]
    fn s3fifo_keeps_reused_blocks_through_a_scan() {
        let mut p = Policy::new(PolicyKind::S3fifo);
        // A hot set of 10 slots read many times, then a one-pass scan of 200 new blocks
        // into a cache of 20 slots: the hot set must survive.
        let cap = 20usize;
        for s in 0..10 {
            p.insert(s, s, BatchHint::SINGLE);
            for _ in 0..3 {
                p.touch(s, BatchHint::SINGLE);
            }
        }
        let mut resident: HashSet<u64> = (0..10).collect();
        for s in 100..300 {
            if resident.len() == cap {
                let v = p.victim(&mut |_| true).unwrap();
                resident.remove(&v);
            }
            p.insert(s, s, BatchHint::SINGLE);
            resident.insert(s);
            for h in 0..10 {
                if resident.contains(&h) {
                    p.touch(h, BatchHint::SINGLE);
                }
            }
        }
        let hot_left = (0..10).filter(|h| resident.contains(h)).count();
        assert_eq!(hot_left, 10, "scan evicted hot blocks");
    }
}
