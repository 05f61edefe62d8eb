//! The one write path to NVMe: every block written (a demotion, a write-behind copy, the
//! stop-time flush) goes through [`NvmeTier::write_block`], which fires the `spill_submit`
//! and `spill_complete` probes, records the `nvme write` latency and forgets blocks the
//! write evicted. Which block to write and what happens to its DRAM copy is the store's
//! business (store/demote.rs, store/write_behind.rs, store/flush.rs); this file knows
//! nothing of DRAM.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kvnode_proto::BlockKey;
use kvnode_spill::{ArenaSlice, IoBuf, SpillError, SpillKey};

use super::{NvmeTier, spill_key};
use crate::residency::RouterMeta;

/// Write-behind and flush counters (reported in stats and `/metrics`).
#[derive(Debug, Default)]
pub struct CopyCounters {
    /// Blocks copied down (kept in DRAM).
    pub copied: AtomicU64,
    /// Copies that failed (the block stays in DRAM without a copy).
    pub failed: AtomicU64,
    /// Write-behind passes (one per tick) that ended with the oldest uncopied block older
    /// than the configured lag (`kvnode_tier_lag_exceeded_total{tier="nvme"}`).
    pub lag_exceeded: AtomicU64,
}

/// One write in flight, counted in [`NvmeTier::in_flight`] until it drops.
#[derive(Debug)]
pub struct InFlight<'a>(&'a NvmeTier);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
        self.0.progress.notify_waiters();
    }
}

impl NvmeTier {
    /// Counts a move in flight (a demotion or copy, from its pick to its end).
    pub fn begin_move(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Relaxed);
        InFlight(self)
    }

    /// Counts a move in flight whose guard is kept elsewhere: end it with [`NvmeTier::end_move`].
    pub fn begin_detached_move(&self) {
        self.in_flight.fetch_add(1, Relaxed);
    }

    /// Ends a move begun with [`NvmeTier::begin_detached_move`].
    pub fn end_move(&self) {
        drop(InFlight(self));
    }

    /// Moves in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Relaxed)
    }

    /// Woken whenever a move ends.
    pub fn progress(&self) -> &tokio::sync::Notify {
        &self.progress
    }

    /// Whether the spill tier stopped taking writes (an IO failure it cannot recover from).
    pub fn poisoned(&self) -> bool {
        self.spill.poisoned().is_some()
    }

    /// Whether the spill tier holds a copy of `k`.
    pub fn has_copy(&self, k: &BlockKey) -> bool {
        self.spill.contains(&spill_key(k))
    }

    /// The spill settings.
    pub fn settings(&self) -> &super::config::SpillSettings {
        &self.settings
    }

    /// Write-behind and flush counters.
    pub fn copies(&self) -> &CopyCounters {
        &self.copies
    }

    /// Writes block `key` (`len` bytes at arena `offset`, a slot the caller keeps leased
    /// until this returns) to NVMe. Every write to the spill tier goes through here.
    pub async fn write_block(
        &self,
        key: &BlockKey,
        offset: u64,
        len: u64,
    ) -> Result<(), SpillError> {
        let sk = spill_key(key);
        let buf = IoBuf::Arena(ArenaSlice {
            offset: offset as usize,
            len: len as usize,
        });
        let id = key.digest.router_hash();
        let t0 = self.metrics.now_ns();
        crate::probes::spill_submit(crate::probes::SPILL_WRITE, id, len);
        let done = self.spill.try_write(sk, buf).await;
        let lat = self.metrics.now_ns().saturating_sub(t0);
        let status = if done.result.is_ok() {
            0
        } else {
            -i64::from(libc::EIO)
        };
        crate::probes::spill_complete(crate::probes::SPILL_WRITE, id, len, status, lat);
        let out = done.result?;
        self.metrics.record_tier("nvme write", lat, len);
        self.evicted(&out.evicted);
        self.forget_marker_evictions();
        Ok(())
    }

    /// Forgets (announces the removal of) blocks the spill tier evicted.
    fn evicted(&self, keys: &[SpillKey]) {
        if !keys.is_empty() {
            self.counters
                .evictions
                .fetch_add(keys.len() as u64, Relaxed);
            self.forget(keys);
        }
    }

    /// Forgets the blocks that delete and clear markers' writes evicted since the last call
    /// (no write outcome reports them): after each block write, and on the demoter's tick,
    /// so they are announced within milliseconds even when no block is written.
    pub fn forget_marker_evictions(&self) {
        self.evicted(&self.spill.take_evicted());
    }

    /// Counts a failed demotion write; true for the first failure of its kind (log it).
    pub fn count_write_failure(&self, e: &SpillError) -> bool {
        let c = match e {
            SpillError::QueueFull { .. } => &self.counters.queue_full,
            _ => &self.counters.errors,
        };
        c.fetch_add(1, Relaxed) == 0
    }

    /// Announces the NVMe store of `key` (its residency, with router metadata `meta`) if the
    /// spill tier holds it and it is not announced yet. The caller holds the DRAM tier's
    /// lock (lock order: DRAM tier, then the residency map), so the DISK store is published
    /// before the DRAM removal that follows under the same lock.
    pub fn announce_stored(&self, key: &BlockKey, meta: Option<&Arc<RouterMeta>>) {
        let sk = spill_key(key);
        // Checked under the map lock, as `forget` does (see there).
        let mut m = self.residencies();
        if self.spill.contains(&sk)
            && !m.contains_key(&sk)
            && let Some(r) = self.announcer.reside(Self::MEDIUM, key, meta)
        {
            m.insert(sk, r);
        }
    }

    /// Adopts a block a predecessor announced on NVMe: registered as announced (`publish`
    /// false: a continued event stream, nothing is sent) or announced now (`publish`: a block
    /// the predecessor announced in DRAM and flushed down). `false` when the spill tier does
    /// not hold it (the caller retracts the announcement).
    pub fn adopt_announced(&self, key: &BlockKey, meta: &Arc<RouterMeta>, publish: bool) -> bool {
        let sk = spill_key(key);
        let mut m = self.residencies();
        if !self.spill.contains(&sk) {
            return false;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = m.entry(sk) {
            let r = if publish {
                self.announcer.reside(Self::MEDIUM, key, Some(meta))
            } else {
                self.announcer.reside_adopted(Self::MEDIUM, key, meta)
            };
            if let Some(r) = r {
                e.insert(r);
            }
        }
        true
    }

    /// Deletes a block written while its DRAM copy was deleted (the delete won).
    pub fn drop_written(&self, key: &BlockKey) {
        let sk = spill_key(key);
        self.spill.delete(&sk);
        self.forget(&[sk]);
    }

    /// Waits until no demotion or copy is in flight, for at most `limit`; returns whether
    /// the tier is idle.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let n = self.progress.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.in_flight.load(Relaxed) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return self.in_flight.load(Relaxed) == 0;
            }
        }
    }

    /// Copies of blocks counted so far: (copied, failed, lag exceeded).
    pub fn copy_counts(&self) -> (u64, u64, u64) {
        (
            self.copies.copied.load(Relaxed),
            self.copies.failed.load(Relaxed),
            self.copies.lag_exceeded.load(Relaxed),
        )
    }
}
