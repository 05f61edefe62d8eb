//! Per-tenant usage, quotas and quota actions, and client connections refused at accept.

use std::fmt;

use kvnode_proto::stats::StatsReport;
use prometheus_client::metrics::MetricType;

use super::{Out, counter_at, gauge_at};

/// `kvnode_tenant_*` (label `tenant`, and `tier` where it applies) and
/// `kvnode_clients_refused_total` (label `reason`).
pub(super) fn tenants(o: &mut Out<'_>, s: &StatsReport) -> fmt::Result {
    let mut f = o.family(
        "tenant_bytes",
        MetricType::Gauge,
        "Bytes of a tenant's blocks, by tier.",
    )?;
    for t in &s.tenants {
        gauge_at(
            &mut f,
            &[("tenant", t.name.as_str()), ("tier", "dram")],
            t.dram_bytes,
        )?;
        gauge_at(
            &mut f,
            &[("tenant", t.name.as_str()), ("tier", "nvme")],
            t.nvme_bytes,
        )?;
    }
    let mut f = o.family(
        "tenant_quota_bytes",
        MetricType::Gauge,
        "A tenant's quota, by tier (only tiers with a quota).",
    )?;
    for t in &s.tenants {
        for (tier, q) in [("dram", t.dram_quota), ("nvme", t.nvme_quota)] {
            if q > 0 {
                gauge_at(&mut f, &[("tenant", t.name.as_str()), ("tier", tier)], q)?;
            }
        }
    }
    let mut f = o.family(
        "tenant_quota_evictions",
        MetricType::Counter,
        "A tenant's own blocks evicted to keep it within its quota, by tier.",
    )?;
    for t in &s.tenants {
        let name = t.name.as_str();
        counter_at(
            &mut f,
            &[("tenant", name), ("tier", "dram")],
            t.dram_quota_evictions,
        )?;
        counter_at(
            &mut f,
            &[("tenant", name), ("tier", "nvme")],
            t.nvme_quota_evictions,
        )?;
    }
    let mut f = o.family(
        "tenant_quota_refusals",
        MetricType::Counter,
        "Keys refused NoSpace because the tenant was at its DRAM quota with nothing evictable.",
    )?;
    for t in &s.tenants {
        counter_at(&mut f, &[("tenant", t.name.as_str())], t.quota_refusals)?;
    }
    let mut f = o.family(
        "clients_refused",
        MetricType::Counter,
        "Client connections refused at accept, by reason; connections, regions and leased_blocks: a uid at its per-uid cap (regions and leased_blocks count refused requests).",
    )?;
    let r = &s.refused;
    for (reason, n) in [
        ("allowlist", r.allowlist),
        ("unmapped", r.unmapped),
        ("no_credentials", r.no_credentials),
        ("pre_hello", r.pre_hello),
        ("connections", r.connections),
        ("regions", r.regions),
        ("leased_blocks", r.leased_blocks),
    ] {
        counter_at(&mut f, &[("reason", reason)], n)?;
    }
    limits(o, s)
}

/// `kvnode_tenant_held` (gauge) and `kvnode_tenant_limit_refusals_total` (labels `tenant`,
/// `what`: connections, regions, leased_blocks).
fn limits(o: &mut Out<'_>, s: &StatsReport) -> fmt::Result {
    let mut f = o.family(
        "tenant_held",
        MetricType::Gauge,
        "What a tenant's clients hold now: connections, attached regions, leased blocks.",
    )?;
    for t in &s.tenants {
        let name = t.name.as_str();
        for (what, n) in [
            ("connections", t.connections),
            ("regions", t.regions),
            ("leased_blocks", t.leased_blocks),
        ] {
            gauge_at(&mut f, &[("tenant", name), ("what", what)], n)?;
        }
    }
    let mut f = o.family(
        "tenant_limit_refusals",
        MetricType::Counter,
        "Connections and requests of a tenant's uids refused at a per-uid cap, by what.",
    )?;
    for t in &s.tenants {
        let name = t.name.as_str();
        for (what, n) in [
            ("connections", t.refused_connections),
            ("regions", t.refused_regions),
            ("leased_blocks", t.refused_leases),
        ] {
            counter_at(&mut f, &[("tenant", name), ("what", what)], n)?;
        }
    }
    Ok(())
}
