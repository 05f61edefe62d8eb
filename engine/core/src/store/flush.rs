//! The stop-time flush (`spill.flush_on_stop_s`): after the last client request, every DRAM
//! block without a copy on NVMe is written there (through the same path as a write-behind
//! copy: store/write_behind.rs, `NvmeTier::write_block`), so the blocks survive a plain
//! stop and start on the same spill directories. Runs on the daemon's tokio runtime.

use std::sync::Arc;
use std::time::Duration;

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
