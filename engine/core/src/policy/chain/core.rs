//! The order behind `chain`: one order per level of use, each by (batch clock, depth), and a
//! ghost list of evicted keys with their use counts.
//!
//! A block's priority is `clock + weight × level`; keeping the levels apart lets the victim
//! be found with the weight of the moment (the lowest of each level's first evictable entry,
//! `MAX_LEVEL + 1` looks) instead of a priority fixed when the block was last referenced.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::super::slots::SlotTable;

/// Uses count up to this many levels (level = uses − 1).
const MAX_LEVEL: usize = 16;
/// Low bits of a stamp that order a batch's pages (parents above children).
const DEPTH_BITS: u32 = 16;
const DEPTH_MAX: u64 = (1 << DEPTH_BITS) - 1;

/// One tracked block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub key_hash: u64,
    pub uses: u8,
    /// `batch clock << 16 | (65535 − depth)`: its place within its level.
    stamp: u64,
}

/// The level of a block used `uses` times.
fn level(uses: u8) -> usize {
    usize::from(uses.saturating_sub(1)).min(MAX_LEVEL)
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
        // A queue item is live while it is its key's newest record; stale ones (a key
        // remembered again or taken back) are dropped as they reach the front, and the queue
        // is kept within twice the cap.
        while self.uses.len() > cap || self.order.len() > 2 * cap.max(1) {
            let Some((k, seq)) = self.order.pop_front() else {
                break;
            };
            if self.uses.get(&k).is_some_and(|&(_, s)| s == seq) {
                self.uses.remove(&k);
            }
        }
    }

    fn take(&mut self, key_hash: u64) -> u8 {
        self.uses.remove(&key_hash).map_or(0, |(u, _)| u)
    }
}

/// An untracked slot's entry: no tracked block has all three at their maximum (a stamp of
/// all ones needs a clock near 2^48 blocks).
const VACANT: Entry = Entry {
    key_hash: u64::MAX,
    uses: u8::MAX,
    stamp: u64::MAX,
};

/// Entries keyed by slot id (a flat per-slot table, ../slots.rs), and per level of use the
/// slots by stamp, lowest first.
#[derive(Debug)]
pub(super) struct Core {
    entries: SlotTable<Entry>,
    levels: Vec<BTreeSet<(u64, u64)>>,
    ghosts: Ghosts,
    ghost_factor: usize,
    ghost_min: usize,
}

impl Core {
    /// An empty order whose ghost list keeps `ghost_factor` keys per entry, at least
    /// `ghost_min`.
    pub fn new(ghost_factor: usize, ghost_min: usize) -> Self {
        Self {
            entries: SlotTable::new(VACANT),
            levels: (0..=MAX_LEVEL).map(|_| BTreeSet::new()).collect(),
            ghosts: Ghosts::default(),
            ghost_factor,
            ghost_min,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Uses remembered for `key_hash` by the ghost list (0: none), forgetting them.
    pub fn take_ghost(&mut self, key_hash: u64) -> u8 {
        self.ghosts.take(key_hash)
    }

    /// Tracks (or re-ranks) `id` with `uses`, referenced in a batch at `batch_clock` at
    /// `depth`.
    pub fn place(&mut self, id: u64, key_hash: u64, uses: u8, batch_clock: u64, depth: u32) {
        self.forget(id);
        let stamp = (batch_clock << DEPTH_BITS) | (DEPTH_MAX - u64::from(depth).min(DEPTH_MAX));
        self.levels[level(uses)].insert((stamp, id));
        self.entries.insert(
            id,
            Entry {
                key_hash,
                uses,
                stamp,
            },
        );
    }

    pub fn forget(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        self.levels[level(e.uses)].remove(&(e.stamp, id));
        Some(e)
    }

    /// Removes the evictable entry of lowest `clock + weight × level` (`weight` in blocks of
    /// clock; ties: the lower level) and remembers it as a ghost.
    pub fn evict(&mut self, weight: u64, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for (lvl, set) in self.levels.iter().enumerate() {
            let Some(&(stamp, id)) = set.iter().find(|&&(_, s)| evictable(s)) else {
                continue;
            };
            let bonus = weight.saturating_mul(lvl as u64) << DEPTH_BITS;
            let prio = stamp.saturating_add(bonus);
            if best.is_none_or(|(p, _)| prio < p) {
                best = Some((prio, id));
            }
        }
        let (_, id) = best?;
        let e = self.forget(id)?;
        let cap = (self.entries.len() * self.ghost_factor).max(self.ghost_min);
        self.ghosts.remember(e.key_hash, e.uses, cap);
        Some(id)
    }

    pub fn get(&self, id: u64) -> Option<Entry> {
        self.entries.get(id)
    }
}
