//! Stall watchdog: ops past their deadline, leases past their age limit, pinning that stopped.
//!
//! Each connection publishes its op in flight and its lease ages in a [`ConnWatch`]; a
//! periodic task scans them. Every finding is counted, fires a probe and is logged once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvnode_proto::obs::{OpKind, StallKind};
use tokio::sync::watch as tokio_watch;

use super::Metrics;
use crate::arena::PinProgress;
use crate::probes;

#[derive(Debug, Clone, Copy)]
struct LeaseAge {
    since_ns: u64,
    pages: u64,
    warned: bool,
}

/// What one connection is doing, readable by the watchdog.
#[derive(Debug, Default)]
pub struct ConnWatch {
    /// Connection id.
    pub conn: u64,
    op: AtomicU32,
    /// Start of the op in flight (ns since daemon start, +1); 0 when idle.
    since: AtomicU64,
    /// The `since` value already reported as past deadline.
    warned: AtomicU64,
    leases: Mutex<HashMap<u64, LeaseAge>>,
}

impl ConnWatch {
    pub(super) fn begin(&self, op: OpKind, now_ns: u64) {
        self.op.store(op.code(), Ordering::Relaxed);
        self.since.store(now_ns + 1, Ordering::Release);
    }

    pub(super) fn end(&self) {
        self.since.store(0, Ordering::Release);
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<u64, LeaseAge>> {
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A lease of `pages` blocks was granted at `now_ns`.
    pub fn lease_begin(&self, lease: u64, pages: u64, now_ns: u64) {
        let age = LeaseAge {
            since_ns: now_ns,
            pages,
            warned: false,
        };
        self.leases().insert(lease, age);
    }

    /// A lease ended.
    pub fn lease_end(&self, lease: u64) {
        self.leases().remove(&lease);
    }

    /// Every lease ended (connection closed).
    pub fn leases_end(&self) {
        self.leases().clear();
    }
}

/// Live connections' watches.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    conns: Mutex<HashMap<u64, Arc<ConnWatch>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnWatch>>> {
        self.conns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers connection `conn`.
    pub fn add(&self, conn: u64) -> Arc<ConnWatch> {
        let w = Arc::new(ConnWatch {
            conn,
            ..ConnWatch::default()
        });
        self.lock().insert(conn, Arc::clone(&w));
        w
    }

    /// Forgets connection `conn`.
    pub fn remove(&self, conn: u64) {
        self.lock().remove(&conn);
    }

    fn all(&self) -> Vec<Arc<ConnWatch>> {
        self.lock().values().cloned().collect()
    }
}

/// The limits the watchdog enforces (from the engine's configuration).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// An op in flight longer than this is a stall.
    pub op_deadline_s: f64,
    /// A lease held longer than this is overdue.
    pub lease_age_limit_s: f64,
}

#[derive(Debug, Default)]
struct PinState {
    populated: u64,
    since_ns: u64,
    warned: bool,
}

/// One scan. Returns nothing; everything found is counted, probed and logged once.
fn scan(m: &Metrics, limits: Limits, progress: &PinProgress, pin: &mut PinState) {
    let now = m.now_ns();
    let deadline = (limits.op_deadline_s * 1e9) as u64;
    let lease_limit = (limits.lease_age_limit_s * 1e9) as u64;
    let (mut ops_over, mut leases_over) = (0u64, 0u64);
    for w in m.watch.all() {
        let since = w.since.load(Ordering::Acquire);
        if since != 0 && now + 1 - since > deadline {
            ops_over += 1;
            if w.warned.swap(since, Ordering::Relaxed) != since {
                let op = w.op.load(Ordering::Relaxed);
                let name = OpKind::from_code(op).map_or("?", OpKind::name);
                let why = format!(
                    "{name} on connection {} in flight past op_deadline_s = {} (client frozen mid-request, or the op is stuck)",
                    w.conn, limits.op_deadline_s
                );
                m.stall(
                    StallKind::OpDeadline,
                    w.conn,
                    now + 1 - since,
                    u64::from(op),
                    &why,
                );
            }
        }
        for (id, l) in w.leases().iter_mut() {
            let age = now.saturating_sub(l.since_ns);
            if age <= lease_limit {
                continue;
            }
            leases_over += 1;
            if !l.warned {
                l.warned = true;
                m.leases_overdue_total.fetch_add(1, Ordering::Relaxed);
                probes::lease_overdue(w.conn, *id, l.pages, age);
                tracing::warn!(
                    conn = w.conn,
                    lease = id,
                    pages = l.pages,
                    age_s = age as f64 / 1e9,
                    limit_s = limits.lease_age_limit_s,
                    "lease held past its age limit: its blocks cannot be evicted; the client \
                     should Release it (leaked lease?)"
                );
            }
        }
    }
    m.ops_overdue_now.store(ops_over, Ordering::Relaxed);
    m.leases_overdue_now.store(leases_over, Ordering::Relaxed);
    let p = progress;
    if !p.done.load(Ordering::Relaxed) {
        let populated = p.populated.load(Ordering::Relaxed);
        if populated != pin.populated || pin.since_ns == 0 {
            *pin = PinState {
                populated,
                since_ns: now,
                warned: false,
            };
        } else if now - pin.since_ns > deadline && !pin.warned {
            pin.warned = true;
            m.stall(
                StallKind::PinStalled,
                0,
                now - pin.since_ns,
                populated,
                "arena population/pinning made no progress (memory pressure or mlock blocking)",
            );
        }
    }
}

/// Scans every `min(op_deadline_s, lease_age_limit_s) / 4` (10 ms .. 1 s) until `stop`.
pub async fn watchdog(
    metrics: Arc<Metrics>,
    limits: Limits,
    progress: Arc<PinProgress>,
    mut stop: tokio_watch::Receiver<bool>,
) {
    let c = limits;
    let tick = (c.op_deadline_s.min(c.lease_age_limit_s) / 4.0).clamp(0.01, 1.0);
    let mut every = tokio::time::interval(Duration::from_secs_f64(tick));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pin = PinState::default();
    loop {
        tokio::select! {
            _ = every.tick() => scan(&metrics, limits, &progress, &mut pin),
            _ = stop.changed() => return,
        }
    }
}
