//! The stop-time flush (`spill.flush_on_stop_s`): every DRAM block without a copy on NVMe is
//! written there (through the same path as a write-behind copy: store/write_behind.rs,
//! `NvmeTier::write_block`), so the blocks survive a plain stop and start on the same spill
//! directories. Runs on the daemon's tokio runtime, in two parts:
//!
//! ```text
//!  SIGTERM ─> copy_while_serving (clients still served): commits from now on queued;
//!             one walk over the arena copies the blocks already here, then the queue is
//!             drained until a pick finds less than a batch
//!          ─> last request ─> flush_queued: what was committed since (or failed)
//! ```
//!
//! The service stops for the second part only, which does not grow with what DRAM holds
//! (issue 42, item 4).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Store;

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

impl Store {
    /// Writes every DRAM block that has no copy on NVMe, `max_in_flight` at a time, for at
    /// most `budget`. Without an NVMe tier there is nothing to do.
    pub async fn flush_dram(self: &Arc<Self>, budget: Duration) -> FlushReport {
        let mut rep = FlushReport::default();
        let Some(nvme) = self.nvme().cloned() else {
            return rep;
        };
        let deadline = tokio::time::Instant::now() + budget;
        let has_copy = |k: &kvnode_proto::BlockKey| nvme.has_copy(k);
        // One pass over the index marks every block that needs a copy (no request runs any
        // more, so holding them all costs nothing); the writes then run `max_in_flight` at a
        // time, a new one as soon as one ends.
        let mut todo = self.dram.pick_uncopied(usize::MAX, &has_copy).into_iter();
        let unfinished = self
            .copy_within(&nvme, deadline, &mut rep, |n| {
                todo.by_ref().take(n).collect()
            })
            .await;
        // Copies never started give their blocks back.
        for c in todo {
            self.dram.finish_copy(&c, false, |_| {});
        }
        rep.left = self.dram.count_uncopied(&has_copy) + unfinished;
        rep
    }

    /// Runs the copies `next(n)` hands out (up to `n` more), `max_in_flight` at a time, a
    /// new one as soon as one ends, until `next` has none and all ended, or `deadline`.
    /// Counts them in `rep`; returns how many were still running (they finish on their own).
    async fn copy_within(
        self: &Arc<Self>,
        nvme: &crate::nvme::NvmeTier,
        deadline: tokio::time::Instant,
        rep: &mut FlushReport,
        mut next: impl FnMut(usize) -> Vec<crate::dram::CopyDown>,
    ) -> u64 {
        let mut running = tokio::task::JoinSet::new();
        let max = nvme.settings().max_in_flight.max(1);
        loop {
            if running.len() < max && !nvme.poisoned() {
                for c in next(max - running.len()) {
                    let s = Arc::clone(self);
                    running.spawn(async move { s.copy_down(c).await });
                }
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
        let unfinished = running.len() as u64;
        running.detach_all();
        unfinished
    }
}

/// What copying down while serving did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrecopyReport {
    /// Blocks written to NVMe.
    pub copied: u64,
    /// Writes that failed.
    pub failed: u64,
    /// Blocks committed meanwhile that were copied too.
    pub since: u64,
    /// The walk over the blocks already in DRAM ended: only what is queued is left for
    /// [`Store::flush_queued`] (otherwise [`Store::flush_dram`] walks them all again).
    pub walked: bool,
    /// The deadline ended it.
    pub timed_out: bool,
}

/// Slots one pick looks at (the DRAM lock is held that long).
const SCAN: usize = 16 * 1024;

impl Store {
    /// Copies DRAM blocks without a copy on NVMe down while clients are still served: from
    /// now on every commit is queued (`DramTier::track_commits`); the blocks already here
    /// are walked in arena order, a bounded stretch at a time; then the queue is drained
    /// until one pick finds less than a batch. What is committed after that is left to
    /// [`Store::flush_queued`], after the last request. Ends early at `deadline` or `stop`.
    pub async fn copy_while_serving(
        self: &Arc<Self>,
        deadline: Instant,
        stop: impl std::future::Future<Output = ()>,
    ) -> PrecopyReport {
        let mut rep = PrecopyReport::default();
        let Some(nvme) = self.nvme().cloned() else {
            return rep;
        };
        self.dram.track_commits();
        let max = nvme.settings().max_in_flight.max(1);
        tokio::pin!(stop);
        let mut from = Some(0);
        let mut walking = true;
        loop {
            if Instant::now() >= deadline || nvme.poisoned() {
                rep.timed_out = true;
                return rep;
            }
            let batch = match from {
                Some(at) if walking => {
                    let has_copy = |k: &kvnode_proto::BlockKey| nvme.has_copy(k);
                    let (batch, next) = self.dram.pick_uncopied_from(at, max, SCAN, &has_copy);
                    from = next;
                    batch
                }
                _ => {
                    walking = false;
                    rep.walked = true;
                    let batch = self.dram.pick_write_behind(max, Instant::now());
                    rep.since += batch.len() as u64;
                    batch
                }
            };
            let last = !walking && batch.len() < max;
            if !batch.is_empty() {
                tokio::select! {
                    (ok, bad) = self.copy_batch(batch) => {
                        rep.copied += ok;
                        rep.failed += bad;
                        if bad > 0 {
                            // A failed copy is queued again: no tight loop on a full queue.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    () = &mut stop => return rep,
                }
            }
            if last {
                return rep;
            }
        }
    }

    /// After [`Store::copy_while_serving`] and the last request: copies what is queued
    /// (committed since, or whose copy failed), `max_in_flight` at a time, for at most
    /// `budget`. Costs what is queued, not what DRAM holds.
    pub async fn flush_queued(self: &Arc<Self>, budget: Duration) -> FlushReport {
        let mut rep = FlushReport::default();
        let Some(nvme) = self.nvme().cloned() else {
            return rep;
        };
        let deadline = tokio::time::Instant::now() + budget;
        // No request runs any more: what is queued now is all there is (a failed copy is
        // queued again with a later time, and not retried here).
        let t0 = Instant::now();
        let unfinished = self
            .copy_within(&nvme, deadline, &mut rep, |n| {
                self.dram.pick_write_behind(n, t0)
            })
            .await;
        rep.left = unfinished + self.dram.queued_copies() as u64;
        rep
    }
}
