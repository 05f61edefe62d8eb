//! Copies down that keep the block in DRAM, and the bounded write-behind (`spill.lag`):
//! every block committed to DRAM gets a copy on NVMe, so a crash or a plain restart on the
//! same spill directories finds it. The copy uses the demotion's write path
//! (`NvmeTier::write_block`: same spill key, same probes and metrics) but ends with the block
//! still in DRAM and marked as having a copy below, so a later demotion costs no write.
//!
//! ```text
//!  tick (lag / 8) ─> DramTier::pick_write_behind (committed ≥ lag/2 ago; DRAM lock)
//!   ─> copy_down per block (max_in_flight at once) ─> NvmeTier::write_block
//!   ─> DramTier::finish_copy (DRAM lock) ─> NvmeTier::announce_stored (map lock, inside)
//! ```
//!
//! `spill.lag` is a target, not a bound: nothing slows puts when NVMe is slower than they
//! are. When the oldest uncopied block is older than the lag, `lag_exceeded` counts it
//! (`kvnode_spill_write_behind_lag_exceeded_total`) and the daemon warns once per episode.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::Store;
use crate::dram::CopyDown;

impl Store {
    /// Writes one block to NVMe and ends its copy; returns whether it is on NVMe now.
    pub(super) async fn copy_down(&self, c: CopyDown) -> bool {
        let Some(nvme) = self.nvme().map(|t| &**t) else {
            self.dram.finish_copy(&c, false, |_| {});
            return false;
        };
        let _move = nvme.begin_move();
        let ok = match nvme.write_block(&c.key, c.offset, c.len).await {
            Ok(()) => true,
            Err(e) => {
                if nvme.copies().failed.fetch_add(1, Relaxed) == 0 {
                    tracing::warn!(error = %e, "copy of a DRAM block to NVMe failed; it stays in DRAM only (first failure; later ones are counted)");
                }
                false
            }
        };
        // Under the DRAM lock, as a demotion announces a store.
        let deleted = self
            .dram
            .finish_copy(&c, ok, |meta| nvme.announce_stored(&c.key, meta));
        if deleted {
            nvme.drop_written(&c.key);
        }
        if ok {
            nvme.copies().copied.fetch_add(1, Relaxed);
        }
        ok && !deleted
    }

    /// Copies a batch concurrently and waits for all of it; returns (copied, failed).
    pub(super) async fn copy_batch(self: &Arc<Self>, batch: Vec<CopyDown>) -> (u64, u64) {
        let tasks: Vec<_> = batch
            .into_iter()
            .map(|c| {
                let s = Arc::clone(self);
                tokio::spawn(async move { s.copy_down(c).await })
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
}

/// Runs the bounded write-behind until `stop` (a tokio task): every block committed to DRAM
/// is picked once it is `lag / 2` old and copied to NVMe, so the write has the other half
/// of the lag, from the moment the NVMe tier is attached. Without an NVMe tier there is
/// nothing to run.
pub fn spawn_write_behind(
    s: Arc<Store>,
    lag: Duration,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if s.spill_phase() == super::SpillPhase::Off {
        return None;
    }
    Some(tokio::spawn(async move {
        // From the moment the NVMe tier is attached (store/lower.rs); every block already
        // in DRAM then is queued.
        let Some(nvme) = s.nvme.ready(&mut stop).await else {
            return;
        };
        s.dram.set_write_behind(true);
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
                let batch = s
                    .dram
                    .pick_write_behind(nvme.settings().max_in_flight, before);
                if batch.is_empty() {
                    break;
                }
                s.copy_batch(batch).await;
                if *stop.borrow() {
                    break;
                }
            }
            let late = s
                .dram
                .oldest_write_behind()
                .is_some_and(|o| o.elapsed() > lag);
            if late {
                nvme.copies().lag_exceeded.fetch_add(1, Relaxed);
                if !warned {
                    tracing::warn!(
                        lag_ms = lag.as_millis() as u64,
                        "write-behind is behind its lag: NVMe is slower than the puts (blocks older than the lag may be lost on a crash)"
                    );
                }
            }
            warned = late;
        }
        // The queue stays on: at a SIGTERM the stop-time flush takes what is left in it
        // (store/flush.rs); a later round turns it on again, which queues every block.
    }))
}
