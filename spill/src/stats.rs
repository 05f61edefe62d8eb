//! Shared tier state: the key index, counters, poison flag and queue trackers, plus the
//! [`SpillStats`] snapshot built from them.

use crate::key::SpillKey;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loc {
    pub file: u16,
    pub region: u32,
    pub generation: u64,
    /// Offset of the block's header sector; the payload starts one sector later.
    pub offset: u64,
    pub len: u32,
    pub seq: u64,
    pub checksum: u64,
}

/// Key to newest verified-on-write (or recovered) location.
#[derive(Debug, Default)]
pub(crate) struct Index {
    map: HashMap<SpillKey, Loc>,
    bytes: u64,
}

impl Index {
    /// Inserts unless a newer copy is already indexed; returns whether it was inserted.
    pub fn insert_if_newer(&mut self, key: SpillKey, loc: Loc) -> bool {
        match self.map.get_mut(&key) {
            Some(old) if old.seq >= loc.seq => false,
            Some(old) => {
                self.bytes = self.bytes - u64::from(old.len) + u64::from(loc.len);
                *old = loc;
                true
            }
            None => {
                self.bytes += u64::from(loc.len);
                self.map.insert(key, loc);
                true
            }
        }
    }

    /// Room for `n` more keys (recovery knows how many it will insert: one allocation, no
    /// rehash while the index grows).
    pub fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
    }

    pub fn get(&self, key: &SpillKey) -> Option<Loc> {
        self.map.get(key).copied()
    }

    pub fn remove(&mut self, key: &SpillKey) -> Option<Loc> {
        let l = self.map.remove(key)?;
        self.bytes -= u64::from(l.len);
        Some(l)
    }

    /// Removes `key` only if it still points at copy `seq` in `file`.
    pub fn remove_if(&mut self, key: &SpillKey, file: u16, seq: u64) -> bool {
        match self.map.get(key) {
            Some(l) if l.file == file && l.seq == seq => self.remove(key).is_some(),
            _ => false,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn keys(&self) -> Vec<SpillKey> {
        self.map.keys().copied().collect()
    }
}

/// Operations submitted to one file's worker and not yet completed, by ticket.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    next: AtomicU64,
    open: Mutex<BTreeMap<u64, Instant>>,
}

impl Tracker {
    pub fn begin(&self) -> u64 {
        let t = self.next.fetch_add(1, Relaxed);
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(t, Instant::now());
        t
    }

    pub fn end(&self, ticket: u64) {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&ticket);
    }

    /// (operations pending, age of the oldest).
    pub fn depth_and_age(&self) -> (usize, Option<Duration>) {
        let m = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (m.len(), m.values().next().map(Instant::elapsed))
    }
}

/// Monotonic counters, updated with relaxed atomics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub errors: AtomicU64,
    pub evictions: AtomicU64,
    pub bounce_copies: AtomicU64,
    pub queue_full: AtomicU64,
    pub syncs: AtomicU64,
    pub marks: AtomicU64,
}

/// State shared by the tier handle and its IO workers.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub index: Mutex<Index>,
    /// Keys that a delete or clear marker's write evicted (reclaiming a region for it): no
    /// block write's outcome reports them, so the tier's owner takes them
    /// ([`crate::SpillTier::take_evicted`]).
    pub orphans: crate::handoff::Handoff<crate::key::SpillKey>,
    pub seq: AtomicU64,
    pub counters: Counters,
    poisoned: AtomicBool,
    poison_reason: Mutex<Option<String>>,
}

impl Shared {
    pub fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Relaxed)
    }

    pub fn poison(&self, reason: &str) {
        let mut r = self
            .poison_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.is_none() {
            tracing::error!(%reason, "spill tier poisoned: refusing further writes, reads continue");
            *r = Some(reason.to_owned());
        }
        self.poisoned.store(true, Relaxed);
    }

    pub fn poisoned(&self) -> Option<String> {
        if !self.poisoned.load(Relaxed) {
            return None;
        }
        self.poison_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn bump(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
}

/// A point-in-time view of the tier, for `kvnode stats` and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpillStats {
    /// Blocks indexed (readable).
    pub blocks: u64,
    /// Payload bytes of indexed blocks.
    pub bytes: u64,
    /// Region bytes of all files.
    pub capacity: u64,
    /// Read operations completed.
    pub reads: u64,
    /// Write operations completed successfully.
    pub writes: u64,
    /// Payload bytes returned by hits.
    pub read_bytes: u64,
    /// Payload bytes written.
    pub write_bytes: u64,
    /// Reads that returned verified bytes.
    pub hits: u64,
    /// Reads that returned no bytes (absent, evicted, corrupt, IO error).
    pub misses: u64,
    /// Reads whose payload failed its checksum or came back short.
    pub checksum_failures: u64,
    /// Blocks recovered at start-up.
    pub recovered_blocks: u64,
    /// Torn or corrupt blocks skipped at start-up.
    pub recovery_skipped: u64,
    /// IO errors (failed reads, writes, fsyncs).
    pub errors: u64,
    /// Blocks evicted to make room (FIFO by region).
    pub evictions: u64,
    /// Operations submitted and not completed, all files.
    pub queue_depth: u64,
    /// Age of the oldest such operation (stall detection).
    pub oldest_queued: Option<Duration>,
    /// Why the tier refuses writes, if it does.
    pub poisoned: Option<String>,
    /// Operations that copied through an aligned bounce buffer.
    pub bounce_copies: u64,
    /// Submissions refused because a queue was full.
    pub queue_full: u64,
    /// fdatasync calls completed.
    pub syncs: u64,
    /// Delete and clear markers written (one per file per delete or clear).
    pub marks_written: u64,
    /// Blocks on disk that a delete or clear marker ended, found at start-up.
    pub recovery_deleted: u64,
}
