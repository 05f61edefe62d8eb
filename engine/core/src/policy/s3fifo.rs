//! S3-FIFO (Yang et al., SOSP '23): a small probationary FIFO, a main FIFO with lazy
//! promotion, and a ghost list of recently evicted keys. Blocks read once leave through the
//! small queue, so a one-pass scan cannot flush the blocks that are read again.

use std::collections::{HashSet, VecDeque};

use super::slots::SlotTable;
use super::{BatchHint, EvictionPolicy, SlotId};

/// Target share of the small queue, in percent of tracked blocks.
const SMALL_PERCENT: usize = 10;
/// Frequency saturates here.
const MAX_FREQ: u8 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    queue: Queue,
    freq: u8,
    key_hash: u64,
    /// Incremented on every (re)queue; stale queue items carry an older value.
    stamp: u32,
}

/// An untracked slot's entry (`freq` never exceeds `MAX_FREQ` in a tracked one).
const VACANT: Entry = Entry {
    queue: Queue::Small,
    freq: u8::MAX,
    key_hash: 0,
    stamp: 0,
};

/// S3-FIFO state. Queues hold `(slot, stamp)`; entries removed or requeued leave stale
/// items behind that are skipped when popped.
#[derive(Debug)]
pub struct S3Fifo {
    entries: SlotTable<Entry>,
    small: VecDeque<(SlotId, u32)>,
    main: VecDeque<(SlotId, u32)>,
    small_live: usize,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
}

impl Default for S3Fifo {
    fn default() -> Self {
        Self {
            entries: SlotTable::new(VACANT),
            small: VecDeque::new(),
            main: VecDeque::new(),
            small_live: 0,
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
        }
    }
}

impl S3Fifo {
    fn enqueue(&mut self, slot: SlotId, queue: Queue) {
        let e = self.entries.get_mut(slot).expect("tracked");
        if e.queue == Queue::Small {
            self.small_live -= 1;
        }
        e.queue = queue;
        e.stamp = e.stamp.wrapping_add(1);
        let item = (slot, e.stamp);
        match queue {
            Queue::Small => {
                self.small_live += 1;
                self.small.push_back(item);
            }
            Queue::Main => self.main.push_back(item),
        }
    }

    fn remember_ghost(&mut self, key_hash: u64) {
        if self.ghost_set.insert(key_hash) {
            self.ghost.push_back(key_hash);
        }
        let cap = self.entries.len().max(16);
        while self.ghost.len() > cap {
            if let Some(old) = self.ghost.pop_front() {
                self.ghost_set.remove(&old);
            }
        }
    }

    fn live(&self, item: (SlotId, u32), queue: Queue) -> Option<Entry> {
        self.entries
            .get(item.0)
            .filter(|e| e.stamp == item.1 && e.queue == queue)
    }

    fn forget(&mut self, slot: SlotId) -> Option<Entry> {
        let e = self.entries.remove(slot)?;
        if e.queue == Queue::Small {
            self.small_live -= 1;
        }
        Some(e)
    }
}

impl EvictionPolicy for S3Fifo {
    fn insert(&mut self, slot: SlotId, key_hash: u64, _hint: BatchHint) {
        self.forget(slot);
        let to_main = self.ghost_set.remove(&key_hash);
        self.entries.insert(
            slot,
            Entry {
                queue: Queue::Small,
                freq: 0,
                key_hash,
                stamp: 0,
            },
        );
        self.small_live += 1;
        // `enqueue` expects the entry counted in its current queue.
        self.enqueue(slot, if to_main { Queue::Main } else { Queue::Small });
    }

    fn touch(&mut self, slot: SlotId, _hint: BatchHint) {
        if let Some(e) = self.entries.get_mut(slot) {
            e.freq = (e.freq + 1).min(MAX_FREQ);
        }
    }

    fn remove(&mut self, slot: SlotId) {
        self.forget(slot);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(SlotId) -> bool) -> Option<SlotId> {
        // Every live entry can be requeued at most MAX_FREQ + 2 times before it is either
        // evicted or found unevictable twice; stale items are dropped as they are popped.
        let mut budget =
            (self.entries.len() * (usize::from(MAX_FREQ) + 2)) + self.small.len() + self.main.len();
        let mut pinned_seen: HashSet<SlotId> = HashSet::new();
        // Unevictable pops from main; once every main entry was seen so, try small.
        let mut main_pinned = 0usize;
        while budget > 0 && !self.entries.is_empty() {
            budget -= 1;
            let small_target = (self.entries.len() * SMALL_PERCENT).div_ceil(100);
            let main_live = self.entries.len() - self.small_live;
            let from_small = self.small_live > 0
                && (self.small_live > small_target || main_live == 0 || main_pinned >= main_live);
            let (item, queue) = if from_small {
                match self.small.pop_front() {
                    Some(i) => (i, Queue::Small),
                    None => continue,
                }
            } else {
                match self.main.pop_front() {
                    Some(i) => (i, Queue::Main),
                    None => continue,
                }
            };
            let Some(e) = self.live(item, queue) else {
                continue;
            };
            let slot = item.0;
            if !evictable(slot) {
                if !pinned_seen.insert(slot) && pinned_seen.len() >= self.entries.len() {
                    // Every tracked slot was found unevictable: give up.
                    self.enqueue(slot, queue);
                    return None;
                }
                if queue == Queue::Main {
                    main_pinned += 1;
                }
                self.enqueue(slot, Queue::Main);
                continue;
            }
            match queue {
                Queue::Small if e.freq > 0 => {
                    self.entries.get_mut(slot).expect("live").freq = 0;
                    self.enqueue(slot, Queue::Main);
                }
                Queue::Main if e.freq > 0 => {
                    self.entries.get_mut(slot).expect("live").freq = e.freq - 1;
                    self.enqueue(slot, Queue::Main);
                }
                Queue::Small => {
                    self.forget(slot);
                    self.remember_ghost(e.key_hash);
                    return Some(slot);
                }
                Queue::Main => {
                    self.forget(slot);
                    return Some(slot);
                }
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}
