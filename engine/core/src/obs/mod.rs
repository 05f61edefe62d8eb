//! In-daemon observability: HDR histograms per op/tier/peer, counters, stall watchdog, Prometheus text.
//!
//! ```text
//!  connection ──op_begin/op_end──> Metrics (histograms, counters, timeline) ──> histograms op, /metrics
//!       └── ConnWatch (op in flight, lease ages) <── watchdog (every tick) ──> stall/lease probes + log
//! ```

pub mod cost;
pub mod hist;
pub mod prom;
mod regions;
mod router;
pub mod watch;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvnode_proto::client::{AllocSlot, ErrorCode, Op, PutStatus, Reply};
use kvnode_proto::obs::{LatencyReport, OpKind, OpStatus, StallKind};

use crate::probes;
pub use hist::{Hist, Timeline};
pub use regions::{RegionCounters, RegionMode};
pub use router::RouterCounters;
pub use watch::{ConnWatch, watchdog};

/// Why a request or a key was refused (label of `kvnode_rejections_total`).
pub const REJECTIONS: [&str; 12] = [
    "no_space",
    "too_large",
    "bad_segment",
    "malformed",
    "handshake",
    "unknown_namespace",
    "not_owned",
    "invalid",
    "unsupported",
    "shutting_down",
    "internal",
    "limit_reached",
];

fn rejection_index(code: ErrorCode) -> usize {
    match code {
        ErrorCode::Malformed => 3,
        ErrorCode::Handshake => 4,
        ErrorCode::UnknownNamespace => 5,
        ErrorCode::NotOwned => 6,
        ErrorCode::Invalid => 7,
        ErrorCode::Unsupported => 8,
        ErrorCode::ShuttingDown => 9,
        ErrorCode::Internal => 10,
        ErrorCode::LimitReached => 11,
    }
}

fn put_rejection(s: PutStatus) -> Option<usize> {
    match s {
        PutStatus::NoSpace => Some(0),
        PutStatus::TooLarge => Some(1),
        PutStatus::BadSegment => Some(2),
        PutStatus::Stored | PutStatus::Exists => None,
    }
}

/// What a reply says about its op: status and bytes handed out through a lease.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplyInfo {
    /// Outcome.
    pub status: Option<OpStatus>,
    /// Bytes the reply hands out (inline payload or leased extents).
    pub bytes: u64,
}

/// Why a client connection was refused at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its uid and gid are outside `allow_uids` / `allow_gids`.
    Allowlist = 0,
    /// No tenant maps it and `[tenants] unmapped = "refuse"`.
    Unmapped = 1,
    /// `SO_PEERCRED` failed while access control is configured.
    NoCredentials = 2,
    /// Its uid already has `max_pre_hello_per_uid` connections that have not sent `Hello`.
    PreHelloCap = 3,
    /// Its uid already has `connections_per_uid` connections open.
    ConnectionCap = 4,
    /// Not a connection: an attach refused at `regions_per_uid`.
    RegionCap = 5,
    /// Not a connection: a holding request refused at `leased_blocks_per_uid`.
    LeaseCap = 6,
}

impl Refusal {
    /// The refusal of a request over a per-uid cap on `what`.
    pub fn over(what: crate::tenant::Held) -> Self {
        match what {
            crate::tenant::Held::Connections => Refusal::ConnectionCap,
            crate::tenant::Held::Regions => Refusal::RegionCap,
            crate::tenant::Held::LeasedBlocks => Refusal::LeaseCap,
        }
    }
}

/// Every counter and histogram of one daemon.
#[derive(Debug)]
pub struct Metrics {
    start: Instant,
    ops: Vec<Hist>,
    op_status: Vec<[AtomicU64; 4]>,
    tiers: Mutex<BTreeMap<String, std::sync::Arc<Hist>>>,
    peers: Mutex<BTreeMap<String, std::sync::Arc<Hist>>>,
    rejections: [AtomicU64; REJECTIONS.len()],
    stalls: Vec<AtomicU64>,
    /// Leases that went past the age limit (total).
    pub leases_overdue_total: AtomicU64,
    /// Client connections the listener failed to accept (out of descriptors or memory).
    pub accept_failures_total: AtomicU64,
    /// Client connections refused at accept (and requests at a per-uid cap), by [`Refusal`].
    clients_refused: [AtomicU64; 7],
    /// Puts whose payload did not arrive within its deadline (connection closed).
    pub put_payload_timeouts_total: AtomicU64,
    /// Blocks stored without their router metadata: the tenant's metadata budget was full.
    pub meta_dropped_total: AtomicU64,
    /// Leases past the age limit still held (set by the watchdog).
    pub leases_overdue_now: AtomicU64,
    /// Ops past their deadline still in flight (set by the watchdog).
    pub ops_overdue_now: AtomicU64,
    in_flight: AtomicU64,
    queues: Mutex<BTreeMap<&'static str, u64>>,
    timeline: Timeline,
    pub(crate) watch: watch::Registry,
    /// Each path's measured cost (the live cost model; cost.rs).
    pub costs: cost::PathCosts,
    /// Fetch plans answered.
    pub plans: cost::PlanCounters,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            ops: OpKind::ALL.iter().map(|_| Hist::default()).collect(),
            op_status: OpKind::ALL.iter().map(|_| Default::default()).collect(),
            tiers: Mutex::default(),
            peers: Mutex::default(),
            rejections: Default::default(),
            stalls: StallKind::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            leases_overdue_total: AtomicU64::new(0),
            accept_failures_total: AtomicU64::new(0),
            clients_refused: Default::default(),
            put_payload_timeouts_total: AtomicU64::new(0),
            meta_dropped_total: AtomicU64::new(0),
            leases_overdue_now: AtomicU64::new(0),
            ops_overdue_now: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            queues: Mutex::default(),
            timeline: Timeline::default(),
            watch: watch::Registry::default(),
            costs: cost::PathCosts::default(),
            plans: cost::PlanCounters::default(),
        }
    }
}

fn idx(op: OpKind) -> usize {
    op.code() as usize - 1
}

fn named(map: &Mutex<BTreeMap<String, std::sync::Arc<Hist>>>, name: &str) -> std::sync::Arc<Hist> {
    let mut m = map
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(h) = m.get(name) {
        return std::sync::Arc::clone(h);
    }
    std::sync::Arc::clone(m.entry(name.to_owned()).or_default())
}

impl Metrics {
    /// Nanoseconds since the daemon started (the watchdog's clock).
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// An op began on `conn`: fires `op_start` and marks it in flight for the watchdog.
    pub fn op_begin(&self, w: &ConnWatch, req: u64, op: OpKind, ns: u32, pages: u32) -> u64 {
        probes::op_start(w.conn, req, op, ns, pages);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let t = self.now_ns();
        w.begin(op, t);
        t
    }

    /// An op ended: records its latency everywhere and fires `op_done`.
    #[expect(clippy::too_many_arguments, reason = "the op_done probe's arguments")]
    pub fn op_end(
        &self,
        w: &ConnWatch,
        req: u64,
        op: OpKind,
        ns: u32,
        pages: u32,
        bytes: u64,
        status: OpStatus,
        started_ns: u64,
    ) {
        let now = self.now_ns();
        let lat = now.saturating_sub(started_ns);
        w.end();
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.ops[idx(op)].record(lat, bytes);
        self.op_status[idx(op)][status.code() as usize].fetch_add(1, Ordering::Relaxed);
        self.timeline.add(now / 1_000_000_000, bytes);
        if status == OpStatus::Ok {
            match op {
                OpKind::Get => self.record_tier("dram read", lat, bytes),
                OpKind::Put => self.record_tier("dram write", lat, bytes),
                _ => {}
            }
        }
        probes::op_done(w.conn, req, op, ns, pages, bytes, status, lat);
    }

    /// Counts the refusals a reply carries and classifies it.
    pub fn reply(&self, reply: &Reply, payload: u64) -> ReplyInfo {
        let reject = |i: usize| self.rejections[i].fetch_add(1, Ordering::Relaxed);
        let (status, bytes) = match reply {
            Reply::Error { code, .. } => {
                reject(rejection_index(*code));
                (OpStatus::Error, 0)
            }
            Reply::Put { results } => {
                let bad = results
                    .iter()
                    .filter_map(|s| put_rejection(*s))
                    .inspect(|&i| {
                        reject(i);
                    })
                    .count();
                (
                    if bad > 0 {
                        OpStatus::Partial
                    } else {
                        OpStatus::Ok
                    },
                    0,
                )
            }
            Reply::Alloc { slots } => {
                let bad = slots
                    .iter()
                    .filter_map(|s| match s {
                        AllocSlot::Refused { status } => put_rejection(*status),
                        AllocSlot::Granted { .. } => None,
                    })
                    .inspect(|&i| {
                        reject(i);
                    })
                    .count();
                (
                    if bad > 0 {
                        OpStatus::Partial
                    } else {
                        OpStatus::Ok
                    },
                    0,
                )
            }
            Reply::TooLarge { .. } => {
                reject(1);
                (OpStatus::Error, 0)
            }
            Reply::GetInline { lens, .. } => {
                (partial_if(lens.iter().any(Option::is_none)), payload)
            }
            Reply::GetLease { extents, .. } => (
                partial_if(extents.iter().any(Option::is_none)),
                extents.iter().flatten().map(|e| e.len).sum(),
            ),
            _ => (OpStatus::Ok, payload),
        };
        ReplyInfo {
            status: Some(status),
            bytes,
        }
    }

    /// Records a latency of a named tier path (`dram read`, `nvme write`, ...).
    pub fn record_tier(&self, name: &str, latency_ns: u64, bytes: u64) {
        named(&self.tiers, name).record(latency_ns, bytes);
    }

    /// Records a pull latency from a peer (by address or name).
    pub fn record_peer(&self, peer: &str, latency_ns: u64, bytes: u64) {
        named(&self.peers, peer).record(latency_ns, bytes);
    }

    /// Sets the depth of a named queue (exported as `kvnode_queue_depth{queue=...}`).
    pub fn set_queue_depth(&self, queue: &'static str, depth: u64) {
        let mut q = self
            .queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.insert(queue, depth);
    }

    /// Counts a stall, fires the `stall` probe and logs it (callers log once per stall).
    pub fn stall(&self, kind: StallKind, id: u64, age_ns: u64, detail: u64, why: &str) {
        self.stalls[kind.code() as usize - 1].fetch_add(1, Ordering::Relaxed);
        probes::stall(kind, id, age_ns, detail);
        tracing::warn!(
            stall = kind.name(),
            id,
            age_s = age_ns as f64 / 1e9,
            detail,
            "stall detected: {why}"
        );
    }

    /// Ops of `op` completed so far (all statuses).
    pub fn op_count(&self, op: OpKind) -> u64 {
        self.ops[idx(op)].count()
    }

    /// Counts a failed accept of a client connection.
    pub fn accept_failed(&self) {
        self.accept_failures_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a put whose payload missed its deadline.
    pub fn put_payload_timed_out(&self) {
        self.put_payload_timeouts_total
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a block stored without its router metadata (the tenant's budget was full).
    pub fn meta_dropped(&self, n: u64) {
        self.meta_dropped_total.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a client connection refused at accept.
    pub fn client_refused(&self, why: Refusal) {
        self.clients_refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Client connections refused at accept so far.
    pub fn refused(&self) -> kvnode_proto::stats::RefusedStats {
        let n = |w: Refusal| self.clients_refused[w as usize].load(Ordering::Relaxed);
        kvnode_proto::stats::RefusedStats {
            allowlist: n(Refusal::Allowlist),
            unmapped: n(Refusal::Unmapped),
            no_credentials: n(Refusal::NoCredentials),
            pre_hello: n(Refusal::PreHelloCap),
            connections: n(Refusal::ConnectionCap),
            regions: n(Refusal::RegionCap),
            leased_blocks: n(Refusal::LeaseCap),
        }
    }

    /// Stalls of `kind` so far.
    pub fn stall_count(&self, kind: StallKind) -> u64 {
        self.stalls[kind.code() as usize - 1].load(Ordering::Relaxed)
    }

    /// The live histograms and throughput (the `histograms` op).
    pub fn report(&self) -> LatencyReport {
        let mut histograms = Vec::new();
        for (op, h) in OpKind::ALL.iter().zip(&self.ops) {
            if h.count() > 0 {
                histograms.push(h.export("op", op.name()));
            }
        }
        let lock = |m: &Mutex<BTreeMap<String, std::sync::Arc<Hist>>>| {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .map(|(k, v)| (k.clone(), std::sync::Arc::clone(v)))
                .collect::<Vec<_>>()
        };
        for (name, h) in lock(&self.tiers) {
            histograms.push(h.export("tier", &name));
        }
        for (name, h) in lock(&self.peers) {
            histograms.push(h.export("peer", &name));
        }
        let mut counters = BTreeMap::new();
        for (k, c) in StallKind::ALL.iter().zip(&self.stalls) {
            counters.insert(format!("stall_{}", k.name()), c.load(Ordering::Relaxed));
        }
        counters.insert(
            "leases_overdue".into(),
            self.leases_overdue_total.load(Ordering::Relaxed),
        );
        let now = self.start.elapsed();
        LatencyReport {
            source: "daemon".into(),
            pids: vec![std::process::id()],
            duration_s: now.as_secs_f64(),
            histograms,
            timeline: self.timeline.points(now.as_secs()),
            counters,
        }
    }
}

/// The namespace handle and key count of a request (0 where the op has none).
pub fn shape(op: &Op) -> (u32, u32) {
    match op {
        Op::Put { ns, keys, .. }
        | Op::Alloc { ns, keys, .. }
        | Op::Get { ns, keys, .. }
        | Op::Exists { ns, keys, .. }
        | Op::Pull { ns, keys, .. }
        | Op::GetToRegion { ns, keys, .. }
        | Op::PutFromRegion { ns, keys, .. }
        | Op::Delete { ns, keys }
        | Op::Touch { ns, keys } => (*ns, keys.len() as u32),
        Op::Commit { handles } | Op::Abort { handles } => (0, handles.len() as u32),
        Op::Clear { ns } => (ns.unwrap_or(u32::MAX), 0),
        _ => (0, 0),
    }
}

fn partial_if(b: bool) -> OpStatus {
    if b { OpStatus::Partial } else { OpStatus::Ok }
}
