//! `chain`: eviction made for prefix-chained KV blocks (issue 40; docs/eviction.md).
//!
//! Every tracked block has a priority; the lowest evictable one leaves first. The priority is
//!
//! ```text
//!   (batch clock + weight × min(uses − 1, MAX_LEVEL)) << DEPTH_BITS  |  (DEPTH_MAX − depth)
//! ```
//!
//! - **batch clock**: a counter of blocks referenced, read once per batch (a lookup or a put
//!   carries one request's pages in prefix order), so all pages of one request share a clock;
//! - **uses**: references of the block, remembered across evictions by a ghost list of recently
//!   evicted keys (a block back from the ghost list resumes its count);
//! - **weight**: one use is worth `tracked × WEIGHT_NUM / WEIGHT_DEN` blocks of clock, so the
//!   balance between recency and frequency scales with the cache;
//! - **depth** (low bits): within a batch a page is worth no more than its parent, so a chain is
//!   cut from its tail, never from its head (a chain whose head left is useless).
//!
//! Every operation is `O(log n)` (a `BTreeSet` ordered by priority); a block costs one map
//! entry and one set entry, a ghost one map entry and one queue entry (keys only).

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::{BatchHint, EvictionPolicy, SlotId};

/// One use is worth `tracked × WEIGHT_NUM / WEIGHT_DEN` blocks of clock (tuned on the first half
/// of the Mooncake traces; docs/eviction.md).
const WEIGHT_NUM: u64 = 1;
const WEIGHT_DEN: u64 = 2;
/// Uses count up to this many levels.
const MAX_LEVEL: u64 = 4;
/// Ghost keys kept, per tracked block.
const GHOST_FACTOR: usize = 4;
/// Ghost keys kept at least (a tier that holds few blocks still learns).
const GHOST_MIN: usize = 1024;
/// Low bits of a priority that order a batch's pages (parents above children).
const DEPTH_BITS: u32 = 16;
const DEPTH_MAX: u64 = (1 << DEPTH_BITS) - 1;

#[derive(Debug, Clone, Copy)]
struct Entry {
    key_hash: u64,
    uses: u8,
    prio: u64,
}

/// Recently evicted keys and their use counts, oldest first.
#[derive(Debug, Default)]
struct Ghosts {
    uses: HashMap<u64, (u8, u64)>,
    order: VecDeque<(u64, u64)>,
    seq: u64,
}

impl Ghosts {
    fn remember(&mut self, key_hash: u64, uses: u8, cap: usize) {
        self.seq += 1;
        self.uses.insert(key_hash, (uses, self.seq));
        self.order.push_back((key_hash, self.seq));
        while self.uses.len() > cap {
            let Some((k, seq)) = self.order.pop_front() else {
                break;
            };
            // Only the newest record of a key removes it.
            if self.uses.get(&k).is_some_and(|&(_, s)| s == seq) {
                self.uses.remove(&k);
            }
        }
        // Stale records (keys remembered again or taken back) bound the queue at twice the map.
        while self.order.len() > 2 * cap.max(1) {
            if let Some((k, seq)) = self.order.pop_front()
                && self.uses.get(&k).is_some_and(|&(_, s)| s == seq)
            {
                self.uses.remove(&k);
            }
        }
    }

    fn take(&mut self, key_hash: u64) -> u8 {
        self.uses.remove(&key_hash).map_or(0, |(u, _)| u)
    }
}

/// The `chain` policy's state.
#[derive(Debug, Default)]
pub struct Chain {
    entries: HashMap<SlotId, Entry>,
    order: BTreeSet<(u64, SlotId)>,
    ghosts: Ghosts,
    /// Blocks referenced so far.
    clock: u64,
    /// The clock the current batch read at its first page.
    batch_clock: u64,
}

impl Chain {
    fn clock_for(&mut self, hint: BatchHint) -> u64 {
        if hint.depth == 0 {
            self.batch_clock = self.clock;
            self.clock += u64::from(hint.len.max(1));
        }
        self.batch_clock
    }

    fn priority(&self, batch_clock: u64, uses: u8, depth: u32) -> u64 {
        let weight = (self.entries.len() as u64 * WEIGHT_NUM) / WEIGHT_DEN;
        let level = u64::from(uses.saturating_sub(1)).min(MAX_LEVEL);
        let time = batch_clock.saturating_add(weight.saturating_mul(level));
        (time << DEPTH_BITS) | (DEPTH_MAX - u64::from(depth).min(DEPTH_MAX))
    }

    fn place(&mut self, slot: SlotId, mut e: Entry, batch_clock: u64, depth: u32) {
        e.prio = self.priority(batch_clock, e.uses, depth);
        self.order.insert((e.prio, slot));
        self.entries.insert(slot, e);
    }

    fn forget(&mut self, slot: SlotId) -> Option<Entry> {
        let e = self.entries.remove(&slot)?;
        self.order.remove(&(e.prio, slot));
        Some(e)
    }
}

impl EvictionPolicy for Chain {
    fn insert(&mut self, slot: SlotId, key_hash: u64, hint: BatchHint) {
        self.forget(slot);
        let batch_clock = self.clock_for(hint);
        let uses = self.ghosts.take(key_hash).saturating_add(1);
        let e = Entry {
            key_hash,
            uses,
            prio: 0,
        };
        self.place(slot, e, batch_clock, hint.depth);
    }

    fn touch(&mut self, slot: SlotId, hint: BatchHint) {
        let batch_clock = self.clock_for(hint);
        if let Some(mut e) = self.forget(slot) {
            e.uses = e.uses.saturating_add(1);
            self.place(slot, e, batch_clock, hint.depth);
        }
    }

    fn remove(&mut self, slot: SlotId) {
        self.forget(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        let &(_, slot) = self.order.iter().find(|&&(_, s)| evictable(s))?;
        let e = self.forget(slot)?;
        let cap = (self.entries.len() * GHOST_FACTOR).max(GHOST_MIN);
        self.ghosts.remember(e.key_hash, e.uses, cap);
        Some(slot)
    }

    fn len(&self) -> usize {
        self.entries.len()
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
