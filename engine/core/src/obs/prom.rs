//! Prometheus text exposition (format 0.0.4) of every `kvnode_` metric; the table is in docs/observability.md.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use kvnode_proto::obs::{OpKind, OpStatus, StallKind};
use kvnode_proto::stats::StatsReport;

use super::{Hist, Metrics, REJECTIONS};

/// Latency buckets: `le` = 2^i ns for i in this range (1.02 us .. 68.7 s).
const LE_POW: std::ops::RangeInclusive<usize> = 10..=36;

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(
            self.0,
            "# HELP kvnode_{name} {help}\n# TYPE kvnode_{name} {kind}"
        );
    }

    fn val(&mut self, name: &str, labels: &str, v: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "kvnode_{name} {v}");
        } else {
            let _ = writeln!(self.0, "kvnode_{name}{{{labels}}} {v}");
        }
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
        self.head(name, kind, help);
        self.val(name, "", v);
    }

    fn hist(&mut self, name: &str, labels: &str, h: &Hist) {
        let slots = h.log2_slots();
        let mut cum = 0u64;
        let mut next = 0usize;
        for p in LE_POW {
            while next < p {
                cum += slots[next];
                next += 1;
            }
            let le = (1u64 << p) as f64 / 1e9;
            self.val(
                &format!("{name}_bucket"),
                &format!("{labels},le=\"{le}\""),
                cum,
            );
        }
        let count: u64 = slots.iter().sum();
        self.val(
            &format!("{name}_bucket"),
            &format!("{labels},le=\"+Inf\""),
            count,
        );
        self.val(&format!("{name}_sum"), labels, h.sum_ns() as f64 / 1e9);
        self.val(&format!("{name}_count"), labels, count);
    }
}

fn ops(o: &mut Out, m: &Metrics) {
    o.head(
        "ops_total",
        "counter",
        "Client ops completed, by op and status.",
    );
    for (op, st) in OpKind::ALL.iter().zip(&m.op_status) {
        for s in OpStatus::ALL {
            let n = st[s.code() as usize].load(Ordering::Relaxed);
            if n > 0 {
                o.val(
                    "ops_total",
                    &format!("op=\"{}\",status=\"{}\"", op.name(), s.name()),
                    n,
                );
            }
        }
    }
    o.head(
        "op_latency_seconds",
        "histogram",
        "Client op latency, request decoded to reply written.",
    );
    for (op, h) in OpKind::ALL.iter().zip(&m.ops) {
        if h.count() > 0 {
            o.hist("op_latency_seconds", &format!("op=\"{}\"", op.name()), h);
        }
    }
    let tiers: Vec<_> = m
        .tiers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(k, v)| (k.clone(), std::sync::Arc::clone(v)))
        .collect();
    o.head(
        "tier_latency_seconds",
        "histogram",
        "Latency of each tier path (tier, direction).",
    );
    for (name, h) in tiers {
        let (tier, dir) = name.split_once(' ').unwrap_or((name.as_str(), ""));
        o.hist(
            "tier_latency_seconds",
            &format!("tier=\"{tier}\",dir=\"{dir}\""),
            &h,
        );
    }
    let peers: Vec<_> = m
        .peers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(k, v)| (k.clone(), std::sync::Arc::clone(v)))
        .collect();
    o.head(
        "peer_latency_seconds",
        "histogram",
        "Pull latency per peer.",
    );
    for (name, h) in peers {
        o.hist("peer_latency_seconds", &format!("peer=\"{name}\""), &h);
    }
}

fn counters(o: &mut Out, m: &Metrics) {
    o.head(
        "rejections_total",
        "counter",
        "Requests or keys refused, by reason.",
    );
    for (r, c) in REJECTIONS.iter().zip(&m.rejections) {
        o.val(
            "rejections_total",
            &format!("reason=\"{r}\""),
            c.load(Ordering::Relaxed),
        );
    }
    o.head(
        "stalls_total",
        "counter",
        "Stalls detected (each logged once), by kind.",
    );
    for (k, c) in StallKind::ALL.iter().zip(&m.stalls) {
        o.val(
            "stalls_total",
            &format!("kind=\"{}\"", k.name()),
            c.load(Ordering::Relaxed),
        );
    }
    o.one(
        "leases_overdue_total",
        "counter",
        "Leases that were held past lease_age_limit_s.",
        m.leases_overdue_total.load(Ordering::Relaxed),
    );
    o.one(
        "leases_overdue",
        "gauge",
        "Leases held past lease_age_limit_s right now.",
        m.leases_overdue_now.load(Ordering::Relaxed),
    );
    o.one(
        "ops_overdue",
        "gauge",
        "Client ops in flight past op_deadline_s right now.",
        m.ops_overdue_now.load(Ordering::Relaxed),
    );
    o.head("queue_depth", "gauge", "Items waiting in each queue.");
    o.val(
        "queue_depth",
        "queue=\"client_requests\"",
        m.in_flight.load(Ordering::Relaxed),
    );
    for (q, d) in m
        .queues
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        o.val("queue_depth", &format!("queue=\"{q}\""), d);
    }
}

/// name, type, help, value of one per-tier metric.
type TierMetric = (
    &'static str,
    &'static str,
    &'static str,
    fn(&kvnode_proto::stats::TierStats) -> f64,
);

/// Client regions by copy mode, and absorbed faults.
fn regions(o: &mut Out, r: &kvnode_proto::stats::RegionStats) {
    o.head(
        "regions_attached_total",
        "counter",
        "Client regions attached, by copy mode (sealed, guarded, pread).",
    );
    for (mode, n) in [
        ("sealed", r.attached_sealed),
        ("guarded", r.attached_guarded),
        ("pread", r.attached_pread),
    ] {
        o.val("regions_attached_total", &format!("mode=\"{mode}\""), n);
    }
    o.one(
        "region_faults_total",
        "counter",
        "Region copies that faulted because a client shrank its memfd (op failed, region detached).",
        r.faults,
    );
}

/// Renders a stats report and the metrics registry.
pub fn render(s: &StatsReport, metrics: &Metrics) -> String {
    let mut o = Out(String::with_capacity(16 << 10));
    o.one(
        "uptime_seconds",
        "gauge",
        "Seconds since the daemon started.",
        s.uptime_s,
    );
    o.one("clients", "gauge", "Connected clients.", s.clients);
    let per_tier: [TierMetric; 10] = [
        ("tier_hits_total", "counter", "Keys found by get.", |t| {
            t.hits as f64
        }),
        (
            "tier_misses_total",
            "counter",
            "Keys not found by get.",
            |t| t.misses as f64,
        ),
        (
            "tier_hit_ratio",
            "gauge",
            "hits / (hits + misses) since start.",
            |t| {
                let n = t.hits + t.misses;
                if n == 0 {
                    0.0
                } else {
                    t.hits as f64 / n as f64
                }
            },
        ),
        ("tier_bytes", "gauge", "Bytes of resident blocks.", |t| {
            t.bytes as f64
        }),
        ("tier_blocks", "gauge", "Resident blocks.", |t| {
            t.blocks as f64
        }),
        (
            "tier_capacity_bytes",
            "gauge",
            "Bytes the tier can hold.",
            |t| t.capacity_bytes as f64,
        ),
        ("tier_inserts_total", "counter", "Blocks stored.", |t| {
            t.inserts as f64
        }),
        (
            "tier_evictions_total",
            "counter",
            "Blocks evicted to make room.",
            |t| t.evictions as f64,
        ),
        ("leases", "gauge", "Block leases held by clients.", |t| {
            t.leases as f64
        }),
        (
            "reservations",
            "gauge",
            "Slots reserved by alloc, not yet committed.",
            |t| t.reserved as f64,
        ),
    ];
    for (name, kind, help, f) in per_tier {
        o.head(name, kind, help);
        for t in &s.tiers {
            o.val(name, &format!("tier=\"{}\"", t.tier), f(t));
        }
    }
    let dram = s.tiers.first().cloned().unwrap_or_default();
    o.one(
        "pinned_bytes",
        "gauge",
        "Arena bytes locked in memory.",
        dram.pinned_bytes,
    );
    o.one(
        "populated_bytes",
        "gauge",
        "Arena bytes faulted in.",
        dram.populated_bytes,
    );
    o.one(
        "pin_refused",
        "gauge",
        "1 if mlock was refused and the arena runs unpinned.",
        u8::from(dram.pin_refused),
    );
    regions(&mut o, &s.regions);
    ops(&mut o, metrics);
    counters(&mut o, metrics);
    o.0
}
