//! Copies of DRAM blocks to NVMe that keep the block in DRAM: the flush at stop
//! (`spill.flush_on_stop_s`) and the bounded write-behind (`spill.lag`).
//!
//! Both use the demotion's write path (same spill key, same fixed-buffer write from the
//! arena) but end with the block still in DRAM and marked as having a copy below, so a later
//! demotion costs no write and a restart on the same spill directory finds the block.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvnode_spill::{ArenaSlice, IoBuf};
use tokio::sync::watch;

use super::{NvmeTier, spill_key};
use crate::dram::CopyDown;

/// Write-behind and flush counters (reported in stats and logs).
#[derive(Debug, Default)]
pub struct CopyCounters {
    /// Blocks copied down (kept in DRAM).
    pub copied: AtomicU64,
    /// Copies that failed (the block stays in DRAM without a copy).
    pub failed: AtomicU64,
    /// Times the oldest uncopied block was older than the configured lag.
    pub lag_exceeded: AtomicU64,
}

/// What a flush did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Blocks written to NVMe.
    pub copied: u64,
    /// Writes that failed.
    pub failed: u64,
    /// Blocks left without a copy when the budget ran out.
    pub left: u64,
    /// The budget ran out.
    pub timed_out: bool,
}

impl NvmeTier {
    /// Writes one block to NVMe and ends its copy; returns whether it is on NVMe now.
    async fn copy_down(&self, c: CopyDown) -> bool {
        self.in_flight.fetch_add(1, Relaxed);
        let ok = self.copy_down_inner(c).await;
        self.in_flight.fetch_sub(1, Relaxed);
        self.progress.notify_waiters();
        ok
    }

    async fn copy_down_inner(&self, c: CopyDown) -> bool {
        let sk = spill_key(&c.key);
        let buf = IoBuf::Arena(ArenaSlice {
            offset: c.offset as usize,
            len: c.len as usize,
        });
        let t0 = self.metrics.now_ns();
        let done = self.spill.try_write(sk, buf).await;
        let lat = self.metrics.now_ns().saturating_sub(t0);
        let ok = match done.result {
            Ok(out) => {
                self.metrics.record_tier("nvme write", lat, c.len);
                if !out.evicted.is_empty() {
                    self.counters
                        .evictions
                        .fetch_add(out.evicted.len() as u64, Relaxed);
                    self.forget(&out.evicted);
                }
                true
            }
            Err(e) => {
                if self.copies.failed.fetch_add(1, Relaxed) == 0 {
                    tracing::warn!(error = %e, "copy of a DRAM block to NVMe failed; it stays in DRAM only (first failure; later ones are counted)");
                }
                false
            }
        };
        let deleted = self.dram.finish_copy(&c, ok, |meta| {
            // Under the DRAM lock, as the demoter announces a store.
            let mut m = self.nvme();
            if self.spill.contains(&sk)
                && !m.contains_key(&sk)
                && let Some(r) = self.announcer.reside(Self::MEDIUM, meta)
            {
                m.insert(sk, r);
            }
        });
        if deleted {
            self.spill.delete(&sk);
            self.forget(&[sk]);
        }
        if ok {
            self.copies.copied.fetch_add(1, Relaxed);
        }
        ok && !deleted
    }

    /// Copies a batch concurrently and waits for all of it; returns (copied, failed).
    async fn copy_batch(self: &Arc<Self>, batch: Vec<CopyDown>) -> (u64, u64) {
        let tasks: Vec<_> = batch
            .into_iter()
            .map(|c| {
                let t = Arc::clone(self);
                tokio::spawn(async move { t.copy_down(c).await })
            })
            .collect();
        let (mut ok, mut bad) = (0, 0);
        for t in tasks {
            if matches!(t.await, Ok(true)) {
                ok += 1;
            } else {
                bad += 1;
            }
        }
        (ok, bad)
    }

    /// Writes every DRAM block that has no copy on NVMe, `max_in_flight` at a time, for at
    /// most `budget`. Run after the last client request: the blocks then survive a plain
    /// stop and start on the same spill directories.
    pub async fn flush_dram(self: &Arc<Self>, budget: Duration) -> FlushReport {
        let deadline = tokio::time::Instant::now() + budget;
        let mut rep = FlushReport::default();
        let has_copy = |k: &kvnode_proto::BlockKey| self.spill.contains(&spill_key(k));
        // One pass over the index marks every block that needs a copy (no request runs any
        // more, so holding them all costs nothing); the writes then run `max_in_flight` at a
        // time, a new one as soon as one ends.
        let mut todo = self.dram.pick_uncopied(usize::MAX, &has_copy).into_iter();
        let mut running = tokio::task::JoinSet::new();
        let max = self.settings.max_in_flight.max(1);
        loop {
            while running.len() < max && self.spill.poisoned().is_none() {
                let Some(c) = todo.next() else { break };
                let t = Arc::clone(self);
                running.spawn(async move { t.copy_down(c).await });
            }
            match tokio::time::timeout_at(deadline, running.join_next()).await {
                Ok(Some(Ok(true))) => rep.copied += 1,
                Ok(Some(_)) => rep.failed += 1,
                Ok(None) => break,
                Err(_) => {
                    rep.timed_out = true;
                    break;
                }
            }
        }
        // Writes still running finish on their own; copies never started give their blocks
        // back.
        let unfinished = running.len() as u64;
        running.detach_all();
        for c in todo {
            self.dram.finish_copy(&c, false, |_| {});
        }
        rep.left = self.dram.count_uncopied(&has_copy) + unfinished;
        rep
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

/// Runs the bounded write-behind until `stop`: every block committed to DRAM is copied to
/// NVMe within `lag` (it is picked once it is `lag / 2` old, so the write has the other half).
pub fn spawn_write_behind(
    t: Arc<NvmeTier>,
    lag: Duration,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    t.dram.set_write_behind(true);
    tokio::spawn(async move {
        let half = lag / 2;
        let period = (lag / 8).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warned = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
            loop {
                let before = Instant::now()
                    .checked_sub(half)
                    .unwrap_or_else(Instant::now);
                let batch = t.dram.pick_write_behind(t.settings.max_in_flight, before);
                if batch.is_empty() {
                    break;
                }
                t.copy_batch(batch).await;
                if *stop.borrow() {
                    break;
                }
            }
            let late = t
                .dram
                .oldest_write_behind()
                .is_some_and(|o| o.elapsed() > lag);
            if late {
                t.copies.lag_exceeded.fetch_add(1, Relaxed);
                if !warned {
                    tracing::warn!(
                        lag_ms = lag.as_millis() as u64,
                        "write-behind is behind its lag: NVMe is slower than the puts (blocks older than the lag may be lost on a crash)"
                    );
                }
            }
            warned = late;
        }
        t.dram.set_write_behind(false);
    })
}
