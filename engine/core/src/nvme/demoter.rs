//! Demotion ahead of need: a tokio task keeps DRAM free space above a watermark by moving LRU blocks to NVMe.
//!
//! Why ahead of need: a slot under a spill write must stay reserved until the write
//! completes, and the allocator runs under the tier lock, so it cannot wait for IO. The
//! demoter starts when free DRAM falls below `low_watermark` and demotes until
//! `high_watermark` (counting moves in flight). A put that finds too little room waits
//! (asynchronously, up to `room_wait_ms`) for demotions it triggers; if they cannot keep up,
//! the allocator evicts without a copy and counts it as `dropped`, with a warning. Nothing
//! here blocks a tokio worker: spill completions are awaited.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvnode_spill::{ArenaSlice, IoBuf, SpillError};
use tokio::sync::watch;

use super::quota::QuotaRoom;
use super::{NvmeTier, config::Admission, spill_key};
use crate::dram::{DemoteEnd, Demotion, Finished};

impl NvmeTier {
    /// Starts demotions if free DRAM is below `high` bytes; returns how many started.
    fn start_demotions(self: &Arc<Self>, high: u64) -> usize {
        if self.spill.poisoned().is_some() {
            return 0;
        }
        let room = self
            .settings
            .max_in_flight
            .saturating_sub(self.in_flight.load(Relaxed));
        if room == 0 {
            return 0;
        }
        let picks = self.dram.pick_demotions(room, high);
        for d in &picks {
            self.in_flight.fetch_add(1, Relaxed);
            let (t, d) = (Arc::clone(self), d.clone());
            tokio::spawn(async move { t.demote(d).await });
        }
        picks.len()
    }

    /// Waits (asynchronously) until DRAM has `need` free bytes, demoting ahead to make
    /// room, for at most `room_wait_ms`. Past that the allocator evicts without a copy.
    pub async fn make_room(self: &Arc<Self>, need: u64) {
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.settings.room_wait_ms);
        loop {
            let progressed = self.progress.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            let (free, cap) = self.dram.free_and_capacity();
            if free >= need {
                return;
            }
            let high = need + (cap as f64 * self.settings.high_watermark) as u64;
            let started = self.start_demotions(high);
            if started == 0 && self.in_flight.load(Relaxed) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, progressed).await.is_err() {
                return;
            }
        }
    }

    async fn demote(&self, d: Demotion) {
        let sk = spill_key(&d.key);
        let mut room = QuotaRoom::Free;
        let end = if d.on_lower && self.spill.contains(&sk) {
            DemoteEnd::Moved
        } else if self.settings.admission == Admission::SecondRead && d.reads < 2 {
            DemoteEnd::Dropped
        } else if self.no_quota_room(&mut room, d.key.ns, d.len) {
            // No room within its tenant's NVMe quota (nvme/quota.rs).
            DemoteEnd::Dropped
        } else {
            let buf = IoBuf::Arena(ArenaSlice {
                offset: d.offset as usize,
                len: d.len as usize,
            });
            let id = d.key.digest.router_hash();
            let t0 = self.metrics.now_ns();
            crate::probes::spill_submit(crate::probes::SPILL_WRITE, id, d.len);
            let done = self.spill.try_write(sk, buf).await;
            let lat = self.metrics.now_ns().saturating_sub(t0);
            let status = if done.result.is_ok() {
                0
            } else {
                -i64::from(libc::EIO)
            };
            crate::probes::spill_complete(crate::probes::SPILL_WRITE, id, d.len, status, lat);
            if done.result.is_ok() {
                self.metrics.record_tier("nvme write", lat, d.len);
                crate::probes::demote(self.dram.handle_of(d.key.ns).unwrap_or(u32::MAX), d.len);
            }
            match done.result {
                Ok(out) => {
                    if !out.evicted.is_empty() {
                        self.counters
                            .evictions
                            .fetch_add(out.evicted.len() as u64, Relaxed);
                        self.forget(&out.evicted);
                    }
                    DemoteEnd::Moved
                }
                Err(SpillError::QueueFull { depth }) => {
                    if self.counters.queue_full.fetch_add(1, Relaxed) == 0 {
                        tracing::warn!(
                            depth,
                            "offload stalled: spill queue full, demotion refused (first time; see nvme errors)"
                        );
                    }
                    DemoteEnd::Failed
                }
                Err(e) => {
                    if self.counters.errors.fetch_add(1, Relaxed) == 0 {
                        tracing::warn!(error = %e, "demotion write failed; the block stays in DRAM (first failure; later ones are counted)");
                    }
                    DemoteEnd::Failed
                }
            }
        };
        self.quota_settle(room, sk, d.key.ns, d.len, end == DemoteEnd::Moved);
        let fin = self.dram.finish_demotion(&d, end, |meta| {
            if end == DemoteEnd::Moved {
                // Checked under the map lock, as `forget` does (see there).
                let mut m = self.nvme();
                if self.spill.contains(&sk)
                    && !m.contains_key(&sk)
                    && let Some(r) = self.announcer.reside(Self::MEDIUM, meta)
                {
                    m.insert(sk, r);
                }
            }
        });
        if fin == Finished::DeletedMeanwhile {
            self.spill.delete(&sk);
            self.forget(&[sk]);
        }
        self.in_flight.fetch_sub(1, Relaxed);
        self.progress.notify_waiters();
    }
}

/// Runs the demoter and the stall monitor until `stop` flips.
pub fn spawn_demoter(
    t: Arc<NvmeTier>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut monitor = Monitor::default();
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
            let (free, cap) = t.dram.free_and_capacity();
            if (free as f64) < cap as f64 * t.settings.low_watermark {
                t.start_demotions((cap as f64 * t.settings.high_watermark) as u64);
            }
            monitor.check(&t);
        }
    })
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
    fn check(&mut self, t: &NvmeTier) {
        if self
            .last
            .is_some_and(|l| l.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last = Some(Instant::now());
        let s = t.stats();
        if let Some(reason) = &s.poisoned
            && !self.poisoned
        {
            self.poisoned = true;
            tracing::error!(%reason, "offload stopped: spill tier poisoned; serving from DRAM, NVMe reads continue");
        }
        let age = Duration::from_millis(s.oldest_queued_ms);
        let stalled = age.as_secs_f64() > t.settings.stall_warn_s;
        if stalled && !self.stalled {
            tracing::warn!(
                queue_depth = s.queue_depth,
                oldest_ms = s.oldest_queued_ms,
                "offload stalled: spill IO is not completing (device slow or hung)"
            );
        }
        self.stalled = stalled;
        let dropped = t.dram.snapshot().tier.dropped;
        if dropped > self.dropped {
            tracing::warn!(
                dropped_now = dropped - self.dropped,
                dropped_total = dropped,
                in_flight = s.in_flight,
                reason = if s.poisoned.is_some() {
                    "spill tier poisoned"
                } else if s.queue_depth > 0 {
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
