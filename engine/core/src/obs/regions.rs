//! Counters of client regions (`stats` → `regions`).

use std::sync::atomic::{AtomicU64, Ordering};

use kvnode_proto::stats::RegionStats;

/// Attach and fault counters, by mode (`stats` → `regions`).
#[derive(Debug, Default)]
pub struct RegionCounters {
    sealed: AtomicU64,
    guarded: AtomicU64,
    pread: AtomicU64,
    faults: AtomicU64,
}

/// How a client region is copied through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionMode {
    /// Sealed against shrinking, mapped.
    Sealed,
    /// Mapped under the SIGBUS guard.
    Guarded,
    /// pread/pwrite.
    Pread,
}

impl RegionCounters {
    /// Counts an attach in `mode`.
    pub fn attached(&self, mode: RegionMode) {
        let n = match mode {
            RegionMode::Sealed => &self.sealed,
            RegionMode::Guarded => &self.guarded,
            RegionMode::Pread => &self.pread,
        };
        n.fetch_add(1, Ordering::Relaxed);
    }

    /// Snapshot for the stats report.
    pub fn report(&self) -> RegionStats {
        RegionStats {
            attached_sealed: self.sealed.load(Ordering::Relaxed),
            attached_guarded: self.guarded.load(Ordering::Relaxed),
            attached_pread: self.pread.load(Ordering::Relaxed),
            faults: self.faults.load(Ordering::Relaxed),
        }
    }

    /// Counts a region copy that faulted.
    pub fn fault(&self) {
        self.faults.fetch_add(1, Ordering::Relaxed);
    }
}
