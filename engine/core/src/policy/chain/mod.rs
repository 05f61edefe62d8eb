//! `chain`: eviction made for prefix-chained KV blocks (issue 40; docs/eviction.md).
//!
//! Every tracked block has a priority; the lowest evictable one leaves first. The priority is
//!
//! ```text
//!   (batch clock + weight × min(uses − 1, 16)) << 16  |  (65535 − depth)
//! ```
//!
//! - **batch clock**: a counter of blocks referenced, read once per batch (a lookup or a put
//!   carries one request's pages in prefix order, [`BatchHint`]), so a request's pages share it;
//! - **uses**: references of the block, remembered across evictions by a ghost list of recently
//!   evicted keys (16 per tracked block): a block back from the ghost list resumes its count;
//! - **weight**: what one use is worth, in blocks of clock: half the blocks tracked when the
//!   victim is chosen (tuned on the first half of each Mooncake trace, docs/eviction.md), so
//!   the balance between recency and reuse scales with the cache;
//! - **depth** (low bits): within a batch a page is worth no more than its parent, so a chain is
//!   cut from its tail, never from its head (a chain whose head left is useless).
//!
//! The weight is applied when a victim is chosen: blocks sit in one order per level of use
//! (by batch clock and depth), and the victim is the lowest of the 17 levels' first evictable
//! blocks with the weight of the moment (core.rs). Every operation is `O(log n)` (a
//! `BTreeSet` per level); a block costs one slot-table entry and one set entry, a ghost one
//! map entry and one queue entry (keys only).
//!
//! ```text
//!  insert/touch ──► batch clock ──► Core (per level, by stamp) ──► victim: lowest evictable
//!  insert ◄── uses of an evicted key ◄── ghost (key, uses) ◄──────────┘
//! ```

mod core;

use self::core::Core;
use super::{BatchHint, EvictionPolicy, SlotId};

/// What one use is worth, per mille of the blocks tracked, in blocks of clock.
const WEIGHT_MILLI: u64 = 500;
/// Ghost keys kept per tracked block.
const GHOST_FACTOR: usize = 16;
/// Ghost keys kept at least (a tier that holds few blocks still learns).
const GHOST_MIN: usize = 1024;

/// The `chain` policy's state.
#[derive(Debug)]
pub struct Chain {
    core: Core,
    /// Blocks referenced so far.
    clock: u64,
    /// The clock the current batch read at its first page.
    batch_clock: u64,
}

impl Default for Chain {
    fn default() -> Self {
        Self {
            core: Core::new(GHOST_FACTOR, GHOST_MIN),
            clock: 0,
            batch_clock: 0,
        }
    }
}

impl Chain {
    fn clock_for(&mut self, hint: BatchHint) -> u64 {
        if hint.depth == 0 {
            self.batch_clock = self.clock;
            self.clock += u64::from(hint.len.max(1));
        }
        self.batch_clock
    }

    /// Ranks `slot` (holding `key_hash`, used `uses` times) for a reference at `hint`.
    fn place(&mut self, slot: SlotId, key_hash: u64, uses: u8, hint: BatchHint) {
        let at = self.clock_for(hint);
        self.core.place(slot, key_hash, uses, at, hint.depth);
    }
}

impl EvictionPolicy for Chain {
    fn insert(&mut self, slot: SlotId, key_hash: u64, hint: BatchHint) {
        self.core.forget(slot);
        let uses = self.core.take_ghost(key_hash).saturating_add(1);
        self.place(slot, key_hash, uses, hint);
    }

    fn touch(&mut self, slot: SlotId, hint: BatchHint) {
        match self.core.get(slot) {
            Some(e) => self.place(slot, e.key_hash, e.uses.saturating_add(1), hint),
            None => {
                self.clock_for(hint);
            }
        }
    }

    fn remove(&mut self, slot: SlotId) {
        self.core.forget(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        // One use is worth `WEIGHT_MILLI` ‰ of the blocks tracked now (not when the block
        // was last referenced: a tier filling up weighs its first blocks as it weighs the rest).
        let weight = (self.core.len() as u64).saturating_mul(WEIGHT_MILLI) / 1000;
        self.core.evict(weight, evictable)
    }

    fn len(&self) -> usize {
        self.core.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Puts `keys` as one batch into a cache of `cap` slots (key = slot id), evicting as needed.
    fn put(p: &mut Chain, resident: &mut HashSet<u64>, keys: &[u64], cap: usize) {
        for (i, &k) in keys.iter().enumerate() {
            if resident.contains(&k) {
                continue;
            }
            if resident.len() >= cap {
                let v = p.victim(&mut |_| true).expect("a victim");
                resident.remove(&v);
            }
            p.insert(k, k, BatchHint::at(i, keys.len()));
            resident.insert(k);
        }
    }

    /// Reads `keys` as one lookup batch.
    fn read(p: &mut Chain, resident: &HashSet<u64>, keys: &[u64]) {
        for (i, &k) in keys.iter().enumerate() {
            if resident.contains(&k) {
                p.touch(k, BatchHint::at(i, keys.len()));
            }
        }
    }

    #[test]
    fn a_chains_head_outlives_its_tail_under_pressure() {
        let mut p = Chain::default();
        for d in 0..8u64 {
            p.insert(d, d, BatchHint::at(d as usize, 8));
        }
        let order: Vec<SlotId> = (0..8).map(|_| p.victim(&mut |_| true).unwrap()).collect();
        assert_eq!(
            order,
            vec![7, 6, 5, 4, 3, 2, 1, 0],
            "evicted head before tail"
        );
    }

    #[test]
    fn a_read_chain_is_cut_from_its_tail_too() {
        let mut p = Chain::default();
        let mut resident = HashSet::new();
        put(&mut p, &mut resident, &[0, 1, 2, 3], 8);
        read(&mut p, &resident, &[0, 1, 2, 3]);
        assert_eq!(p.victim(&mut |_| true), Some(3));
        assert_eq!(
            p.victim(&mut |s| s != 2),
            Some(1),
            "the predicate is honoured"
        );
    }

    #[test]
    fn a_one_touch_scan_does_not_flush_reused_chains() {
        let cap = 40;
        let mut p = Chain::default();
        let mut resident = HashSet::new();
        let hot: Vec<Vec<u64>> = (0..4u64)
            .map(|c| (0..5).map(|d| c * 100 + d).collect())
            .collect();
        for chain in &hot {
            put(&mut p, &mut resident, chain, cap);
        }
        // The cache fills with blocks seen once, then the hot chains are read again.
        let filler: Vec<u64> = (5_000..5_020).collect();
        put(&mut p, &mut resident, &filler, cap);
        assert_eq!(resident.len(), cap);
        for _ in 0..3 {
            for chain in &hot {
                read(&mut p, &resident, chain);
            }
        }
        // A scan of one-touch blocks as long as the cache, in requests of 5 pages.
        for r in 0..(cap as u64 / 5) {
            let scan: Vec<u64> = (0..5).map(|d| 10_000 + r * 5 + d).collect();
            put(&mut p, &mut resident, &scan, cap);
        }
        let lost: Vec<u64> = hot
            .iter()
            .flatten()
            .filter(|k| !resident.contains(k))
            .copied()
            .collect();
        assert!(lost.is_empty(), "the scan evicted reused blocks {lost:?}");
    }

    #[test]
    fn reuse_is_weighed_with_the_blocks_tracked_when_the_victim_is_chosen() {
        // Block 0 is read again while it is the only block, then 9 blocks arrive one by one.
        // One use is worth half the blocks tracked at each eviction (5, 4, 4, 3 blocks of
        // clock): block 0 (read at clock 1) outlives blocks 1–3 (clocks 2–4), though a weight
        // taken when it was read (one block tracked) would have been nil.
        let mut p = Chain::default();
        p.insert(0, 0, BatchHint::SINGLE);
        p.touch(0, BatchHint::SINGLE);
        for s in 1..10 {
            p.insert(s, s, BatchHint::SINGLE);
        }
        let order: Vec<SlotId> = (0..10).map(|_| p.victim(&mut |_| true).unwrap()).collect();
        assert_eq!(order[0], 1, "the reused block left first: {order:?}");
        assert!(
            order.iter().position(|&s| s == 0) == Some(3),
            "the reused block left before the blocks it outranks: {order:?}"
        );
    }

    #[test]
    fn an_evicted_blocks_reuse_is_remembered() {
        // Block 1 was read twice before it left; back, it outranks a block seen once.
        let mut p = Chain::default();
        p.insert(1, 1, BatchHint::SINGLE);
        p.touch(1, BatchHint::SINGLE);
        p.touch(1, BatchHint::SINGLE);
        for s in 2..4 {
            p.insert(s, s, BatchHint::SINGLE);
        }
        assert_eq!(p.victim(&mut |s| s == 1), Some(1));
        p.insert(1, 1, BatchHint::SINGLE);
        p.insert(9, 9, BatchHint::SINGLE);
        let order: Vec<SlotId> = (0..4).map(|_| p.victim(&mut |_| true).unwrap()).collect();
        assert_eq!(
            order.last(),
            Some(&1),
            "the ghost's uses were lost: {order:?}"
        );
    }
}
