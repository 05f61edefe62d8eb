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

use kvnode_proto::Key;

use super::Store;
use crate::dram::{DemoteEnd, Demotion, Finished, TierError};
use crate::nvme::config::Admission;
use crate::nvme::{NvmeTier, QuotaRoom, spill_key};

impl Store {
    /// Starts demotions if free DRAM is below `high` bytes; returns how many started.
    fn start_demotions(self: &Arc<Self>, nvme: &Arc<NvmeTier>, high: u64) -> usize {
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
        let started = picks.len();
        for d in picks {
            let m = Move::begin(self, nvme, d, false);
            tokio::spawn(m.run());
        }
        started
    }

    /// `kv.demote`: writes the named resident blocks to NVMe now and frees their DRAM (their
    /// retention ends). Each move runs in a task of its own, so a caller that goes away
    /// leaves none half done. The NVMe admission policy does not apply (the router asked);
    /// the tenant's NVMe quota does.
    pub async fn demote_now(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
    ) -> Result<DemotedNow, TierError> {
        let Some(nvme) = self.nvme().cloned() else {
            return Err(TierError::NoLowerTier);
        };
        let (picks, skipped) = self.dram.pick_keys(ns, keys)?;
        let moves: Vec<_> = picks
            .into_iter()
            .map(|d| tokio::spawn(Move::begin(self, &nvme, d, true).run()))
            .collect();
        let mut out = DemotedNow {
            skipped,
            ..DemotedNow::default()
        };
        for m in moves {
            match m.await {
                Ok(DemoteEnd::Moved) => out.moved += 1,
                Ok(DemoteEnd::Dropped) => out.refused += 1,
                Ok(DemoteEnd::Failed) | Err(_) => out.failed += 1,
            }
        }
        Ok(out)
    }

    /// Waits (bounded) until DRAM has `need` bytes free, demoting to NVMe ahead of need, for
    /// at most `room_wait_ms`. Past that the allocator evicts without a copy. Without an
    /// NVMe tier it returns at once.
    pub async fn make_room(self: &Arc<Self>, need: u64) {
        let Some(nvme) = self.nvme().cloned() else {
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
}

/// One demotion from its pick to its end. It owns what has to be given back exactly once: the
/// picked block (ended in DRAM with [`DramTier::finish_demotion`]), its place among the NVMe
/// moves in flight, and the bytes it holds in its tenant's NVMe quota. [`Move::run`] ends it
/// with what happened; dropped before that (its task ended early), it ends as failed: the
/// block stays in DRAM, the quota bytes go back, the move stops counting.
///
/// [`DramTier::finish_demotion`]: crate::dram::DramTier::finish_demotion
struct Move {
    store: Arc<Store>,
    nvme: Arc<NvmeTier>,
    d: Demotion,
    room: QuotaRoom,
    ended: bool,
    /// Asked for by name (`kv.demote`): the admission policy does not apply.
    asked: bool,
}

impl Move {
    /// Counts the move in flight from its pick on.
    fn begin(store: &Arc<Store>, nvme: &Arc<NvmeTier>, d: Demotion, asked: bool) -> Self {
        nvme.begin_detached_move();
        Self {
            store: Arc::clone(store),
            nvme: Arc::clone(nvme),
            d,
            room: QuotaRoom::Free,
            ended: false,
            asked,
        }
    }

    /// Moves the picked block down: writes it (unless NVMe has it already, admission or
    /// its tenant's NVMe quota says no) and ends the move.
    async fn run(mut self) -> DemoteEnd {
        let (nvme, d) = (&self.nvme, &self.d);
        let end = if d.on_lower && nvme.has_copy(&d.key) {
            DemoteEnd::Moved
        } else if !self.asked && nvme.settings().admission == Admission::SecondRead && d.reads < 2 {
            DemoteEnd::Dropped
        } else if nvme.no_quota_room(&mut self.room, d.key.ns, d.len) {
            // No room within its tenant's NVMe quota (nvme/quota.rs).
            DemoteEnd::Dropped
        } else {
            match nvme.write_block(&d.key, d.offset, d.len).await {
                Ok(()) => {
                    let ns = self.store.dram.handle_of(d.key.ns).unwrap_or(u32::MAX);
                    crate::probes::demote(ns, d.len);
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
        self.end(end);
        end
    }

    /// Settles the quota, ends the demotion in DRAM (announcing the DISK store first when
    /// the block moved) and stops counting the move.
    fn end(&mut self, end: DemoteEnd) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let (nvme, d) = (&self.nvme, &self.d);
        let moved = end == DemoteEnd::Moved;
        nvme.quota_settle(self.room, spill_key(&d.key), d.key.ns, d.len, moved);
        let fin = self.store.dram.finish_demotion(d, end, |meta| {
            if moved {
                nvme.announce_stored(&d.key, meta);
            }
        });
        if fin == Finished::DeletedMeanwhile {
            nvme.drop_written(&d.key);
        }
        nvme.end_move();
    }
}

impl Drop for Move {
    fn drop(&mut self) {
        self.end(DemoteEnd::Failed);
    }
}

/// Runs the demoter and the stall monitor until `stop` flips (a tokio task), from the
/// moment the NVMe tier is attached (store/lower.rs). Without an NVMe tier there is nothing
/// to run.
pub fn spawn_demoter(
    s: Arc<Store>,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if s.spill_phase() == super::SpillPhase::Off {
        return None;
    }
    Some(tokio::spawn(async move {
        let Some(nvme) = s.nvme.ready(&mut stop).await else {
            return;
        };
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
            nvme.forget_marker_evictions();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::get_tests::{filled, key, page};

    /// A demotion whose task ends before it wrote (dropped): the move stops counting, the
    /// block stays in DRAM, readable, and nothing is left leased or demoting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_move_dropped_before_its_write_ends_as_failed() {
        let f = filled("move-drop").await;
        let nvme = f.store.nvme().cloned().expect("an NVMe tier");
        let cap = f.store.dram.free_and_capacity().1;
        let picks = f.store.dram.pick_demotions(1, cap);
        let d = picks.into_iter().next().expect("a block to demote");
        let slot_key = d.key;
        let before = nvme.in_flight();
        let m = Move::begin(&f.store, &nvme, d, false);
        assert_eq!(nvme.in_flight(), before + 1, "counted from its pick");
        drop(m);
        assert_eq!(nvme.in_flight(), before, "the move stopped counting");
        let t = f.store.dram.snapshot().tier;
        assert_eq!((t.in_flight, t.leases), (0, 0), "{t:?}");
        let i = (0..48)
            .find(|&i| key(i).0 == slot_key.digest)
            .expect("the demoted key is one of the fixture's");
        let l = f.store.lease(f.ns, &[key(i)]).await.unwrap();
        let l = l[0].as_ref().expect("the block stayed");
        assert_eq!(l.bytes(), page(i).as_slice());
    }
}

/// What a `kv.demote` did, per key.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DemotedNow {
    /// Written to NVMe (or already there) and gone from DRAM.
    pub moved: u32,
    /// Left DRAM without a copy: no room in the tenant's NVMe quota.
    pub refused: u32,
    /// The write failed: the block stays in DRAM.
    pub failed: u32,
    /// Not resident in DRAM, leased by a reader, or already moving.
    pub skipped: u32,
}
