//! The priority order behind `chain`: entries ordered by priority, and a ghost list of evicted
//! keys with their use counts.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::super::slots::SlotTable;

/// Uses count up to this many levels.
const MAX_LEVEL: u64 = 16;
/// Low bits of a priority that order a batch's pages (parents above children).
const DEPTH_BITS: u32 = 16;
const DEPTH_MAX: u64 = (1 << DEPTH_BITS) - 1;

/// One tracked block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub key_hash: u64,
    pub uses: u8,
    prio: u64,
}

/// A priority of `uses` at `batch_clock` and `depth`, where one use is worth
/// `tracked × weight_milli / 1000` blocks of clock.
fn priority(tracked: usize, weight_milli: u64, batch_clock: u64, uses: u8, depth: u32) -> u64 {
    let weight = (tracked as u64).saturating_mul(weight_milli) / 1000;
    let level = u64::from(uses.saturating_sub(1)).min(MAX_LEVEL);
    let time = batch_clock.saturating_add(weight.saturating_mul(level));
    (time << DEPTH_BITS) | (DEPTH_MAX - u64::from(depth).min(DEPTH_MAX))
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

/// An untracked slot's entry: no tracked block has all three at their maximum (a priority
/// of all ones needs a clock near 2^48 blocks).
const VACANT: Entry = Entry {
    key_hash: u64::MAX,
    uses: u8::MAX,
    prio: u64::MAX,
};

/// Entries keyed by slot id (a flat per-slot table, ../slots.rs), lowest priority first.
#[derive(Debug)]
pub(super) struct Core {
    entries: SlotTable<Entry>,
    order: BTreeSet<(u64, u64)>,
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
            order: BTreeSet::new(),
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

    /// Tracks (or re-ranks) `id` with `uses` at `batch_clock` and `depth`.
    pub fn place(&mut self, id: u64, key_hash: u64, uses: u8, at: Placement) {
        self.forget(id);
        let prio = priority(at.tracked, at.weight_milli, at.batch_clock, uses, at.depth);
        self.order.insert((prio, id));
        self.entries.insert(
            id,
            Entry {
                key_hash,
                uses,
                prio,
            },
        );
    }

    pub fn forget(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        self.order.remove(&(e.prio, id));
        Some(e)
    }

    /// Removes the lowest entry for which `evictable` holds and remembers it as a ghost.
    pub fn evict(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        let &(_, id) = self.order.iter().find(|&&(_, s)| evictable(s))?;
        let e = self.forget(id)?;
        let cap = (self.entries.len() * self.ghost_factor).max(self.ghost_min);
        self.ghosts.remember(e.key_hash, e.uses, cap);
        Some(id)
    }

    pub fn get(&self, id: u64) -> Option<Entry> {
        self.entries.get(id)
    }
}

/// Where a reference puts a block in the order.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placement {
    /// The clock of the reference's batch.
    pub batch_clock: u64,
    /// Its place in the batch.
    pub depth: u32,
    /// What one use is worth, per mille of `tracked`, in blocks of clock.
    pub weight_milli: u64,
    /// Blocks the policy tracks.
    pub tracked: usize,
}
