//! Prometheus text exposition (format 0.0.4) of every `kvnode_` metric, encoded by
//! `prometheus-client`; the table is in docs/observability.md.
//!
//! Why a [`Collector`] and not instruments: the daemon already counts everything it exports
//! (atomics in [`Metrics`], HDR histograms in [`Hist`], the stats report), and those feed the
//! `histograms`/`stats` ops and kvtrace's cross-checks too. A collector reads them when
//! Prometheus scrapes, so each event is recorded once, where it happens; the crate
//! owns the exposition format (names, label escaping, `_total`, `le` and `+Inf`, HELP/TYPE).
//! The `metrics` facade with `metrics-exporter-prometheus` would record every event a second
//! time into its own registry (and bucket latencies again), and brings its own HTTP listener.
//!
//! Counters are declared without `_total`: the encoder appends it, so the exported names are
//! those of the table.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvnode_proto::cluster::ClusterSummary;
use kvnode_proto::obs::{OpKind, OpStatus, StallKind};
use kvnode_proto::stats::{RegionStats, StatsReport, TierStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{Hist, Metrics, REJECTIONS};

/// `Content-Type` of [`Exporter::render`]'s output (Prometheus text 0.0.4).
pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Latency buckets: `le` = 2^i ns for i in this range (1.02 us .. 68.7 s), then `+Inf`.
const LE_POW: std::ops::RangeInclusive<usize> = 10..=36;

/// Where the collector reads the stats report at scrape time (the engine's `stats()`).
type StatsFn = Box<dyn Fn() -> StatsReport + Send + Sync>;

/// The registry served at `/metrics`: one collector over the daemon's own counters.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
}

impl Exporter {
    /// An exporter reading `stats()` and `metrics` on every render.
    pub fn new(
        stats: impl Fn() -> StatsReport + Send + Sync + 'static,
        metrics: Arc<Metrics>,
    ) -> Self {
        let mut registry = Registry::with_prefix("kvnode");
        registry.register_collector(Box::new(Kvnode {
            stats: Box::new(stats),
            metrics,
        }));
        Self { registry }
    }

    /// Every metric, in the Prometheus text format ([`CONTENT_TYPE`]). Errors only if a value
    /// cannot be encoded (writing into a `String` itself cannot fail).
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut out = String::with_capacity(16 << 10);
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// The collector: reads the stats report and the metrics registry when scraped.
struct Kvnode {
    stats: StatsFn,
    metrics: Arc<Metrics>,
}

impl fmt::Debug for Kvnode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kvnode").finish_non_exhaustive()
    }
}

impl Collector for Kvnode {
    fn encode(&self, d: DescriptorEncoder) -> fmt::Result {
        let s = (self.stats)();
        let mut o = Out(d);
        daemon(&mut o, &s)?;
        regions(&mut o, &s.regions)?;
        if let Some(c) = &s.cluster {
            cluster(&mut o, c)?;
        }
        tenants::tenants(&mut o, &s)?;
        if let Some(e) = &s.events {
            events::events(&mut o, e)?;
        }
        peers::peers(&mut o, &s)?;
        router::router(&mut o, &s.router)?;
        plans::plans(&mut o, &s)?;
        ops(&mut o, &self.metrics)?;
        counters(&mut o, &self.metrics)
    }
}

mod events;
mod peers;
mod plans;
mod router;
mod tenants;

/// A descriptor encoder with one method per metric shape.
struct Out<'a>(DescriptorEncoder<'a>);

impl Out<'_> {
    /// HELP and TYPE of a family whose samples follow (one per label set).
    fn family(
        &mut self,
        name: &'static str,
        kind: MetricType,
        help: &str,
    ) -> Result<MetricEncoder<'_>, fmt::Error> {
        self.0.encode_descriptor(name, help, None, kind)
    }

    fn counter(&mut self, name: &'static str, help: &str, v: u64) -> fmt::Result {
        ConstCounter::new(v).encode(self.family(name, MetricType::Counter, help)?)
    }

    fn gauge(&mut self, name: &'static str, help: &str, v: impl EncodeGaugeValue) -> fmt::Result {
        ConstGauge::new(v).encode(self.family(name, MetricType::Gauge, help)?)
    }
}

fn counter_at(f: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: u64) -> fmt::Result {
    ConstCounter::new(v).encode(f.encode_family(labels)?)
}

fn gauge_at(
    f: &mut MetricEncoder<'_>,
    labels: &impl EncodeLabelSet,
    v: impl EncodeGaugeValue,
) -> fmt::Result {
    ConstGauge::new(v).encode(f.encode_family(labels)?)
}

/// One histogram sample set from an HDR histogram's power-of-two slots: bucket `le = 2^p ns`
/// holds the samples below 2^p ns (the encoder accumulates; `+Inf` is the count).
fn hist_at(f: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, h: &Hist) -> fmt::Result {
    let slots = h.log2_slots();
    let mut next = 0usize;
    let buckets: Vec<(f64, u64)> = LE_POW
        .map(|p| {
            let n = slots[next..p].iter().sum();
            next = p;
            ((1u64 << p) as f64 / 1e9, n)
        })
        .collect();
    let count = slots.iter().sum();
    f.encode_family(labels)?.encode_histogram::<NoLabelSet>(
        h.sum_ns() as f64 / 1e9,
        count,
        &buckets,
        None,
    )
}

/// name, type, help, value of one per-tier metric.
type TierMetric = (
    &'static str,
    MetricType,
    &'static str,
    fn(&TierStats) -> u64,
);

const PER_TIER: [TierMetric; 17] = [
    (
        "tier_hits",
        MetricType::Counter,
        "Keys found by get.",
        |t| t.hits,
    ),
    (
        "tier_misses",
        MetricType::Counter,
        "Keys not found by get.",
        |t| t.misses,
    ),
    (
        "tier_bytes",
        MetricType::Gauge,
        "Bytes of resident blocks.",
        |t| t.bytes,
    ),
    ("tier_blocks", MetricType::Gauge, "Resident blocks.", |t| {
        t.blocks
    }),
    (
        "tier_capacity_bytes",
        MetricType::Gauge,
        "Bytes the tier can hold.",
        |t| t.capacity_bytes,
    ),
    ("tier_inserts", MetricType::Counter, "Blocks stored.", |t| {
        t.inserts
    }),
    (
        "tier_evictions",
        MetricType::Counter,
        "Blocks evicted to make room.",
        |t| t.evictions,
    ),
    (
        "leases",
        MetricType::Gauge,
        "Block leases held by clients.",
        |t| t.leases,
    ),
    (
        "reservations",
        MetricType::Gauge,
        "Slots reserved by alloc, not yet committed.",
        |t| t.reserved,
    ),
    (
        "tier_copied_down",
        MetricType::Counter,
        "Blocks copied to NVMe while kept in DRAM (write-behind, stop-time flush).",
        |t| t.copied_down,
    ),
    (
        "tier_retained_blocks",
        MetricType::Gauge,
        "Blocks held in DRAM by kv.retain.",
        |t| t.retained_blocks,
    ),
    (
        "tier_retained_bytes",
        MetricType::Gauge,
        "Bytes of blocks held in DRAM by kv.retain.",
        |t| t.retained_bytes,
    ),
    (
        "tier_retain_refused",
        MetricType::Counter,
        "Keys kv.retain refused because the tenant's retained quota was full.",
        |t| t.retain_refused,
    ),
    (
        "tier_retain_expired",
        MetricType::Counter,
        "kv.retain holds that ended because their time ran out.",
        |t| t.retain_expired,
    ),
    (
        "tier_lag_exceeded",
        MetricType::Counter,
        "Times the oldest block waiting for write-behind was older than spill.lag.",
        |t| t.lag_exceeded,
    ),
    (
        "tier_delete_markers",
        MetricType::Counter,
        "Delete and clear markers written to the spill log (one per file per delete or clear).",
        |t| t.delete_markers,
    ),
    (
        "tier_recovered_deleted",
        MetricType::Counter,
        "Blocks found at start-up that a delete or clear made before the restart ended.",
        |t| t.recovered_deleted,
    ),
];

/// Daemon-wide gauges and the per-tier table of the stats report.
fn daemon(o: &mut Out<'_>, s: &StatsReport) -> fmt::Result {
    o.gauge(
        "uptime_seconds",
        "Seconds since the daemon started.",
        s.uptime_s,
    )?;
    o.gauge("clients", "Connected clients.", s.clients)?;
    for (name, kind, help, value) in PER_TIER {
        let mut f = o.family(name, kind, help)?;
        for t in &s.tiers {
            let labels = [("tier", t.tier.as_str())];
            match kind {
                MetricType::Counter => counter_at(&mut f, &labels, value(t))?,
                _ => gauge_at(&mut f, &labels, value(t))?,
            }
        }
    }
    let mut f = o.family(
        "tier_hit_ratio",
        MetricType::Gauge,
        "hits / (hits + misses) since start.",
    )?;
    for t in &s.tiers {
        let n = t.hits + t.misses;
        let ratio = if n == 0 {
            0.0
        } else {
            t.hits as f64 / n as f64
        };
        gauge_at(&mut f, &[("tier", t.tier.as_str())], ratio)?;
    }
    let dram = s.tiers.first().cloned().unwrap_or_default();
    o.gauge(
        "pinned_bytes",
        "Arena bytes locked in memory.",
        dram.pinned_bytes,
    )?;
    o.gauge(
        "populated_bytes",
        "Arena bytes faulted in.",
        dram.populated_bytes,
    )?;
    o.gauge(
        "pin_refused",
        "1 if mlock was refused and the arena runs unpinned.",
        u32::from(dram.pin_refused),
    )?;
    o.gauge(
        "spill_recovering",
        "1 while the spill index is rebuilt (DRAM serves alone meanwhile).",
        u32::from(s.spill_recovering),
    )
}

/// Client regions by copy mode, and absorbed faults.
fn regions(o: &mut Out<'_>, r: &RegionStats) -> fmt::Result {
    let mut f = o.family(
        "regions_attached",
        MetricType::Counter,
        "Client regions attached, by copy mode (sealed, guarded, pread).",
    )?;
    for (mode, n) in [
        ("sealed", r.attached_sealed),
        ("guarded", r.attached_guarded),
        ("pread", r.attached_pread),
    ] {
        counter_at(&mut f, &[("mode", mode)], n)?;
    }
    o.counter(
        "region_faults",
        "Region copies that faulted because a client shrank its memfd (op failed, region detached).",
        r.faults,
    )
}

/// Cluster membership (only when the daemon runs with `--cluster`; docs/cluster.md).
fn cluster(o: &mut Out<'_>, c: &ClusterSummary) -> fmt::Result {
    let flag = |b: bool| i64::from(b);
    o.gauge(
        "cluster_members",
        "Live cluster members known (this daemon included).",
        c.members,
    )?;
    o.gauge(
        "cluster_incompatible_members",
        "Live members whose peer protocol differs from this daemon's (hints to them are refused).",
        c.incompatible_members,
    )?;
    o.gauge(
        "cluster_etcd_healthy",
        "1 while etcd answers (lease kept alive, watch running).",
        flag(c.etcd_healthy),
    )?;
    o.gauge(
        "cluster_registered",
        "1 while this daemon's record is registered under a live lease.",
        flag(c.registered),
    )?;
    o.gauge(
        "cluster_membership_in_force",
        "1 while membership authorizes hints (healthy, or within the grace after etcd stopped answering).",
        flag(c.in_force),
    )?;
    o.gauge(
        "cluster_membership_age_seconds",
        "Seconds since etcd last confirmed the membership.",
        c.membership_age_s,
    )?;
    o.counter(
        "cluster_reconnects",
        "etcd sessions started after the first (reconnects, re-registrations).",
        c.reconnects,
    )?;
    o.counter(
        "cluster_refused_hints",
        "Hints refused by cluster membership (not a live member, incompatible, membership expired).",
        c.refused_hints,
    )
}

/// A snapshot of a name → histogram map (the lock is not held while encoding).
fn named(
    m: &std::sync::Mutex<std::collections::BTreeMap<String, Arc<Hist>>>,
) -> Vec<(String, Arc<Hist>)> {
    m.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(k, v)| (k.clone(), Arc::clone(v)))
        .collect()
}

/// Op counts and latencies, tier and peer latencies.
fn ops(o: &mut Out<'_>, m: &Metrics) -> fmt::Result {
    let mut f = o.family(
        "ops",
        MetricType::Counter,
        "Client ops completed, by op and status.",
    )?;
    for (op, st) in OpKind::ALL.iter().zip(&m.op_status) {
        for s in OpStatus::ALL {
            let n = st[s.code() as usize].load(Ordering::Relaxed);
            if n > 0 {
                counter_at(&mut f, &[("op", op.name()), ("status", s.name())], n)?;
            }
        }
    }
    let mut f = o.family(
        "op_latency_seconds",
        MetricType::Histogram,
        "Client op latency, request decoded to reply written.",
    )?;
    for (op, h) in OpKind::ALL.iter().zip(&m.ops) {
        if h.count() > 0 {
            hist_at(&mut f, &[("op", op.name())], h)?;
        }
    }
    let mut f = o.family(
        "tier_latency_seconds",
        MetricType::Histogram,
        "Latency of each tier path (tier, direction).",
    )?;
    for (name, h) in named(&m.tiers) {
        let (tier, dir) = name.split_once(' ').unwrap_or((name.as_str(), ""));
        hist_at(&mut f, &[("tier", tier), ("dir", dir)], &h)?;
    }
    let mut f = o.family(
        "peer_latency_seconds",
        MetricType::Histogram,
        "Pull latency per peer.",
    )?;
    for (name, h) in named(&m.peers) {
        hist_at(&mut f, &[("peer", name.as_str())], &h)?;
    }
    Ok(())
}

/// Refusals, stalls, overdue leases and ops, queue depths.
fn counters(o: &mut Out<'_>, m: &Metrics) -> fmt::Result {
    let mut f = o.family(
        "rejections",
        MetricType::Counter,
        "Requests or keys refused, by reason.",
    )?;
    for (r, c) in REJECTIONS.iter().zip(&m.rejections) {
        counter_at(&mut f, &[("reason", *r)], c.load(Ordering::Relaxed))?;
    }
    let mut f = o.family(
        "stalls",
        MetricType::Counter,
        "Stalls detected (each logged once), by kind.",
    )?;
    for (k, c) in StallKind::ALL.iter().zip(&m.stalls) {
        counter_at(&mut f, &[("kind", k.name())], c.load(Ordering::Relaxed))?;
    }
    o.counter(
        "leases_overdue",
        "Leases that were held past lease_age_limit_s.",
        m.leases_overdue_total.load(Ordering::Relaxed),
    )?;
    o.gauge(
        "leases_overdue",
        "Leases held past lease_age_limit_s right now.",
        m.leases_overdue_now.load(Ordering::Relaxed),
    )?;
    o.counter(
        "accept_failures",
        "Client connections the listener failed to accept (out of descriptors or memory).",
        m.accept_failures_total.load(Ordering::Relaxed),
    )?;
    o.counter(
        "put_payload_timeouts",
        "Puts whose payload did not arrive within put_payload_timeout_s (+1 s per 64 MiB); the connection was closed and its reservations freed.",
        m.put_payload_timeouts_total.load(Ordering::Relaxed),
    )?;
    o.counter(
        "meta_dropped",
        "Blocks stored without router metadata (not announced as KV events): their tenant's metadata budget was full.",
        m.meta_dropped_total.load(Ordering::Relaxed),
    )?;
    o.gauge(
        "ops_overdue",
        "Client ops in flight past op_deadline_s right now.",
        m.ops_overdue_now.load(Ordering::Relaxed),
    )?;
    let mut f = o.family(
        "queue_depth",
        MetricType::Gauge,
        "Items waiting in each queue.",
    )?;
    gauge_at(
        &mut f,
        &[("queue", "client_requests")],
        m.in_flight.load(Ordering::Relaxed),
    )?;
    let queues: Vec<(&'static str, u64)> = m
        .queues
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(q, d)| (*q, *d))
        .collect();
    for (q, d) in queues {
        gauge_at(&mut f, &[("queue", q)], d)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn tier(name: &str, hits: u64, misses: u64, leases: u64) -> TierStats {
        TierStats {
            tier: name.into(),
            hits,
            misses,
            leases,
            ..TierStats::default()
        }
    }

    /// A daemon's worth of numbers: two tiers, ops, tier and peer latencies, refusals, stalls.
    fn render() -> String {
        let m = Arc::new(Metrics::default());
        let get = super::super::idx(OpKind::Get);
        m.ops[get].record(1500, 4096);
        m.ops[get].record(3_000_000, 4096);
        m.op_status[get][OpStatus::Ok.code() as usize].fetch_add(2, Ordering::Relaxed);
        m.record_tier("nvme read", 70_000, 4096);
        m.record_peer("10.0.0.2:7100", 2_000_000, 1 << 20);
        m.record_peer("odd\"peer", 1000, 1);
        m.rejections[0].fetch_add(5, Ordering::Relaxed);
        m.leases_overdue_total.fetch_add(3, Ordering::Relaxed);
        m.leases_overdue_now.fetch_add(1, Ordering::Relaxed);
        m.set_queue_depth("spill", 7);
        let stats = StatsReport {
            uptime_s: 12.5,
            clients: 2,
            tiers: vec![tier("dram", 3, 1, 4), tier("nvme", 0, 0, 0)],
            regions: RegionStats {
                attached_guarded: 1,
                faults: 1,
                ..RegionStats::default()
            },
            cluster: Some(ClusterSummary {
                members: 3,
                etcd_healthy: true,
                registered: true,
                in_force: true,
                membership_age_s: 0.5,
                refused_hints: 2,
                ..ClusterSummary::default()
            }),
            events: Some(kvnode_proto::stats::EventsStats {
                dropped_tenant_budget: 4,
                tenants: vec![kvnode_proto::stats::EventsTenantStats {
                    name: "a".into(),
                    dropped: 4,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..StatsReport::default()
        };
        Exporter::new(move || stats.clone(), m).render().unwrap()
    }

    #[test]
    fn samples_keep_their_names_labels_and_values() {
        let text = render();
        let lines: BTreeSet<&str> = text.lines().collect();
        for want in [
            "# TYPE kvnode_ops_total counter",
            "kvnode_ops_total{op=\"get\",status=\"ok\"} 2",
            "kvnode_uptime_seconds 12.5",
            "kvnode_clients 2",
            "kvnode_tier_hits_total{tier=\"dram\"} 3",
            "kvnode_tier_hits_total{tier=\"nvme\"} 0",
            "kvnode_tier_hit_ratio{tier=\"dram\"} 0.75",
            "kvnode_tier_hit_ratio{tier=\"nvme\"} 0.0",
            "kvnode_leases{tier=\"dram\"} 4",
            "kvnode_pin_refused 0",
            "kvnode_regions_attached_total{mode=\"guarded\"} 1",
            "kvnode_region_faults_total 1",
            "kvnode_rejections_total{reason=\"no_space\"} 5",
            "kvnode_rejections_total{reason=\"internal\"} 0",
            "kvnode_stalls_total{kind=\"op_deadline\"} 0",
            "# TYPE kvnode_leases_overdue_total counter",
            "kvnode_leases_overdue_total 3",
            "# TYPE kvnode_leases_overdue gauge",
            "kvnode_leases_overdue 1",
            "kvnode_ops_overdue 0",
            "kvnode_queue_depth{queue=\"client_requests\"} 0",
            "kvnode_queue_depth{queue=\"spill\"} 7",
            "# TYPE kvnode_op_latency_seconds histogram",
            // 1500 ns is below 2^11 ns, 3 ms below 2^22 ns; buckets are cumulative.
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"1.024e-06\"} 0",
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"2.048e-06\"} 1",
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"0.002097152\"} 1",
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"0.004194304\"} 2",
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"68.719476736\"} 2",
            "kvnode_op_latency_seconds_bucket{op=\"get\",le=\"+Inf\"} 2",
            "kvnode_op_latency_seconds_sum{op=\"get\"} 0.0030015",
            "kvnode_op_latency_seconds_count{op=\"get\"} 2",
            "kvnode_tier_latency_seconds_count{tier=\"nvme\",dir=\"read\"} 1",
            "kvnode_peer_latency_seconds_count{peer=\"10.0.0.2:7100\"} 1",
            "kvnode_peer_latency_seconds_count{peer=\"odd\\\"peer\"} 1",
            "kvnode_cluster_members 3",
            "kvnode_cluster_etcd_healthy 1",
            "kvnode_cluster_membership_in_force 1",
            "kvnode_cluster_membership_age_seconds 0.5",
            "kvnode_cluster_refused_hints_total 2",
        ] {
            assert!(lines.contains(want), "missing {want}:\n{text}");
        }
        // 27 finite buckets (2^10 .. 2^36 ns) and +Inf per histogram; ops never seen are absent.
        let get_buckets = text
            .lines()
            .filter(|l| l.starts_with("kvnode_op_latency_seconds_bucket{op=\"get\""))
            .count();
        assert_eq!(get_buckets, 28);
        assert!(!text.contains("op=\"put\""), "{text}");
    }

    /// `(name, type)` of every family in docs/observability.md's metrics table.
    fn documented() -> BTreeSet<(String, String)> {
        let doc = include_str!("../../../../docs/observability.md");
        let table = doc
            .split("\n## Metrics")
            .nth(1)
            .expect("docs/observability.md has a Metrics section");
        let section = table.split("\n## ").next().unwrap_or(table);
        let mut out = BTreeSet::new();
        for row in section.lines().filter(|l| l.starts_with("| `kvnode_")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let names: Vec<&str> = cells[1].split('`').skip(1).step_by(2).collect();
            let kinds: Vec<&str> = cells[2]
                .split(" / ")
                .map(|k| k.split_whitespace().next().unwrap())
                .collect();
            for (i, n) in names.iter().enumerate() {
                let kind = if kinds.len() == names.len() {
                    kinds[i]
                } else {
                    kinds[0]
                };
                out.insert(((*n).to_owned(), kind.to_owned()));
            }
        }
        out
    }

    #[test]
    fn exported_families_are_exactly_the_documented_ones() {
        let text = render();
        let exported: BTreeSet<(String, String)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (n, k) = l.split_once(' ').unwrap();
                (n.to_owned(), k.to_owned())
            })
            .collect();
        assert_eq!(exported, documented());
    }
}
