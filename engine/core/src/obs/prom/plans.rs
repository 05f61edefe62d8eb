//! `kvnode_path_*` (the live cost model, one series per measured path) and
//! `kvnode_plans_*` (fetch plans answered; docs/fetch-plans.md).

use std::fmt;

use kvnode_proto::stats::StatsReport;
use prometheus_client::metrics::MetricType;

use super::{Out, counter_at, gauge_at};

/// The cost model's figures and the plan counters.
pub(super) fn plans(o: &mut Out<'_>, s: &StatsReport) -> fmt::Result {
    let mut f = o.family(
        "path_fixed_seconds",
        MetricType::Gauge,
        "Measured fixed cost per operation of a path (dram_copy, dram_region, dram_gpu, nvme_read, peer <addr> x<connections>).",
    )?;
    for c in &s.costs {
        gauge_at(&mut f, &[("path", c.path.as_str())], c.fixed_s)?;
    }
    let mut f = o.family(
        "path_rate_bytes_per_second",
        MetricType::Gauge,
        "Measured rate of a path past its fixed cost.",
    )?;
    for c in &s.costs {
        gauge_at(&mut f, &[("path", c.path.as_str())], c.bytes_per_s)?;
    }
    let mut f = o.family(
        "path_operations",
        MetricType::Counter,
        "Operations a path's figure was measured from.",
    )?;
    for c in &s.costs {
        counter_at(&mut f, &[("path", c.path.as_str())], c.samples)?;
    }
    let p = &s.plans;
    let mut f = o.family(
        "plans",
        MetricType::Counter,
        "Fetch plans answered, by reason: all (every available key fetched), slower (cut where a path is slower than recompute), probe (cut at a bounded probe of an unmeasured path), nothing.",
    )?;
    for (reason, v) in [
        ("all", p.all),
        ("slower", p.slower),
        ("probe", p.probe),
        ("nothing", p.nothing),
    ] {
        counter_at(&mut f, &[("reason", reason)], v)?;
    }
    let mut f = o.family(
        "plan_keys",
        MetricType::Counter,
        "Keys of fetch plans, by decision: fetch, or recompute (available but slower to fetch).",
    )?;
    counter_at(&mut f, &[("decision", "fetch")], p.keys_fetch)?;
    counter_at(&mut f, &[("decision", "recompute")], p.keys_recompute)?;
    o.counter(
        "plan_pulls_skipped",
        "Hinted lookups whose peer pull was not started because the plan left the peer out.",
        p.pulls_skipped,
    )
}
