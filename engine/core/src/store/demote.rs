//! Demotion, the move down from DRAM to NVMe ahead of need: a tokio task keeps DRAM free
//! space above a watermark by moving LRU blocks to NVMe.
//!
//! Why ahead of need: a slot under a spill write must stay leased until the write
//! completes, and the allocator runs under the tier lock, so it cannot wait for IO. The
//! demoter starts when free DRAM falls below `low_watermark` and demotes until
//! `high_watermark` (counting moves in flight). A put (or a promotion) that finds too little
//! room waits (asynchronously, up to `room_wait_ms`) for demotions it triggers; if they
//! cannot keep up, the allocator evicts without a copy and counts it as `dropped`, with a
//! warning. Nothing here blocks a tokio worker: spill completions are awaited.
//!
//! ```text
//!  DramTier::pick_demotions (victims leased, out of the policy; DRAM lock)
//!   ─> NvmeTier::write_block (spill probes, `nvme write` latency; no lock held)
//!   ─> DramTier::finish_demotion (DRAM lock) ─> NvmeTier::announce_stored (map lock, inside)
//!      DISK store announced, then the DRAM removal, in that order
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::Store;
use crate::dram::{DemoteEnd, Demotion, Finished};
use crate::nvme::config::Admission;
use crate::nvme::{NvmeTier, QuotaRoom, spill_key};

impl Store {
    /// Starts demotions if free DRAM is below `high` bytes; returns how many started.
    fn start_demotions(self: &Arc<Self>, nvme: &NvmeTier, high: u64) -> usize {
        if nvme.poisoned() {
            return 0;
        }
        let room = nvme
            .settings()
            .max_in_flight
            .saturating_sub(nvme.in_flight());
        if room == 0 {
            return 0;
        }
        let picks = self.dram.pick_demotions(room, high);
        for d in &picks {
            nvme.begin_detached_move();
            let (s, d) = (Arc::clone(self), d.clone());
            tokio::spawn(async move { s.demote(d).await });
        }
        picks.len()
    }

    /// Waits (bounded) until DRAM has `need` bytes free, demoting to NVMe ahead of need, for
    /// at most `room_wait_ms`. Past that the allocator evicts without a copy. Without an
    /// NVMe tier it returns at once.
    pub async fn make_room(self: &Arc<Self>, need: u64) {
        let Some(nvme) = self.nvme.clone() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + nvme.room_wait();
        let high_share = nvme.settings().high_watermark;
        loop {
            let progressed = nvme.progress().notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            let (free, cap) = self.dram.free_and_capacity();
            if free >= need {
                return;
            }
            let high = need + (cap as f64 * high_share) as u64;
            let started = self.start_demotions(&nvme, high);
            if started == 0 && nvme.in_flight() == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, progressed).await.is_err() {
                return;
            }
        }
    }

    /// Moves one picked block down: writes it (unless NVMe has it already, admission or
    /// its tenant's NVMe quota says no) and ends the demotion in DRAM.
    async fn demote(&self, d: Demotion) {
        let Some(nvme) = self.nvme.as_deref() else {
            return;
        };
        let sk = spill_key(&d.key);
        let mut room = QuotaRoom::Free;
        let end = if d.on_lower && nvme.has_copy(&d.key) {
            DemoteEnd::Moved
        } else if nvme.settings().admission == Admission::SecondRead && d.reads < 2 {
            DemoteEnd::Dropped
        } else if nvme.no_quota_room(&mut room, d.key.ns, d.len) {
            // No room within its tenant's NVMe quota (nvme/quota.rs).
            DemoteEnd::Dropped
        } else {
            match nvme.write_block(&d.key, d.offset, d.len).await {
                Ok(()) => {
                    crate::probes::demote(self.dram.handle_of(d.key.ns).unwrap_or(u32::MAX), d.len);
                    DemoteEnd::Moved
                }
                Err(e) => {
                    if nvme.count_write_failure(&e) {
                        tracing::warn!(error = %e, "demotion write failed or the spill queue is full; the block stays in DRAM (first failure; later ones are counted in nvme errors)");
                    }
                    DemoteEnd::Failed
                }
            }
        };
        nvme.quota_settle(room, sk, d.key.ns, d.len, end == DemoteEnd::Moved);
        let fin = self.dram.finish_demotion(&d, end, |meta| {
            if end == DemoteEnd::Moved {
                nvme.announce_stored(&d.key, meta);
            }
        });
        if fin == Finished::DeletedMeanwhile {
            nvme.drop_written(&d.key);
        }
        nvme.end_move();
    }
}

/// Runs the demoter and the stall monitor until `stop` flips (a tokio task). Without an
/// NVMe tier there is nothing to run.
pub fn spawn_demoter(
    s: Arc<Store>,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let nvme = s.nvme.clone()?;
    Some(tokio::spawn(async move {
        let mut monitor = Monitor::default();
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
            let (free, cap) = s.dram.free_and_capacity();
            if (free as f64) < cap as f64 * nvme.settings().low_watermark {
                s.start_demotions(&nvme, (cap as f64 * nvme.settings().high_watermark) as u64);
            }
            monitor.check(&s, &nvme);
        }
    }))
}

/// Logs stalled offload once per episode, with the reason.
#[derive(Debug, Default)]
struct Monitor {
    last: Option<Instant>,
    dropped: u64,
    stalled: bool,
    poisoned: bool,
}

impl Monitor {
    fn check(&mut self, s: &Store, t: &NvmeTier) {
        if self
            .last
            .is_some_and(|l| l.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last = Some(Instant::now());
        let st = t.stats();
        if let Some(reason) = &st.poisoned
            && !self.poisoned
        {
            self.poisoned = true;
            tracing::error!(%reason, "offload stopped: spill tier poisoned; serving from DRAM, NVMe reads continue");
        }
        let age = Duration::from_millis(st.oldest_queued_ms);
        let stalled = age.as_secs_f64() > t.settings().stall_warn_s;
        if stalled && !self.stalled {
            tracing::warn!(
                queue_depth = st.queue_depth,
                oldest_ms = st.oldest_queued_ms,
                "offload stalled: spill IO is not completing (device slow or hung)"
            );
        }
        self.stalled = stalled;
        let dropped = s.dram.snapshot().tier.dropped;
        if dropped > self.dropped {
            tracing::warn!(
                dropped_now = dropped - self.dropped,
                dropped_total = dropped,
                in_flight = st.in_flight,
                reason = if st.poisoned.is_some() {
                    "spill tier poisoned"
                } else if st.queue_depth > 0 {
                    "demotion cannot keep up with puts"
                } else {
                    "blocks not admitted or DRAM full of leased blocks"
                },
                "DRAM evicted blocks without a copy on NVMe"
            );
            self.dropped = dropped;
        }
    }
}
