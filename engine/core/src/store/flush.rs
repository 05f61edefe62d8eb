//! The stop-time flush (`spill.flush_on_stop_s`): every DRAM block without a copy on NVMe is
//! written there (through the same path as a write-behind copy: store/write_behind.rs,
//! `NvmeTier::write_block`), so the blocks survive a plain stop and start on the same spill
//! directories. Runs on the daemon's tokio runtime, in two parts:
//!
//! ```text
//!  SIGTERM ─> copy_while_serving: passes over the arena while clients are still served,
//!             until a pass finds little left (or its share of the budget is spent)
//!          ─> last request ─> flush_dram: what the last pass and the puts since left
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
        let mut running = tokio::task::JoinSet::new();
        let max = nvme.settings().max_in_flight.max(1);
        loop {
            while running.len() < max && !nvme.poisoned() {
                let Some(c) = todo.next() else { break };
                let s = Arc::clone(self);
                running.spawn(async move { s.copy_down(c).await });
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
}

/// What copying down while serving did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrecopyReport {
    /// Passes over the arena.
    pub passes: u32,
    /// Blocks written to NVMe.
    pub copied: u64,
    /// Writes that failed.
    pub failed: u64,
    /// Blocks the last pass found without a copy.
    pub last_pass: u64,
    /// The deadline ended it.
    pub timed_out: bool,
}

/// Slots one pick looks at (the DRAM lock is held that long).
const SCAN: usize = 16 * 1024;

impl Store {
    /// Copies DRAM blocks without a copy on NVMe down while clients are still served, in
    /// passes over the arena, until a pass finds at most `enough` such blocks (the rest is
    /// left to [`Store::flush_dram`] after the last request), `deadline`, or `stop`.
    pub async fn copy_while_serving(
        self: &Arc<Self>,
        enough: u64,
        deadline: Instant,
        stop: impl std::future::Future<Output = ()>,
    ) -> PrecopyReport {
        let mut rep = PrecopyReport::default();
        let Some(nvme) = self.nvme().cloned() else {
            return rep;
        };
        let max = nvme.settings().max_in_flight.max(1);
        tokio::pin!(stop);
        loop {
            rep.passes += 1;
            let mut found = 0u64;
            let mut from = Some(0);
            while let Some(at) = from {
                if Instant::now() >= deadline || nvme.poisoned() {
                    rep.timed_out = true;
                    rep.last_pass = found;
                    return rep;
                }
                let has_copy = |k: &kvnode_proto::BlockKey| nvme.has_copy(k);
                let (batch, next) = self.dram.pick_uncopied_from(at, max, SCAN, &has_copy);
                from = next;
                found += batch.len() as u64;
                if batch.is_empty() {
                    continue;
                }
                tokio::select! {
                    (ok, bad) = self.copy_batch(batch) => {
                        rep.copied += ok;
                        rep.failed += bad;
                    }
                    () = &mut stop => {
                        rep.last_pass = found;
                        return rep;
                    }
                }
            }
            rep.last_pass = found;
            if found <= enough {
                return rep;
            }
        }
    }
}
