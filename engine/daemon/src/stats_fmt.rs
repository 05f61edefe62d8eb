//! Human tables for `kvnode stats`.

use std::fmt::Write;

use kvnode_proto::size::ByteSize;
use kvnode_proto::stats::StatsReport;

fn rate(h: u64, m: u64) -> String {
    if h + m == 0 {
        "-".into()
    } else {
        format!("{:.1}%", h as f64 * 100.0 / (h + m) as f64)
    }
}

/// Renders the report as aligned tables.
/// One line of cluster health (daemons started with `--cluster`).
fn cluster_line(c: &kvnode_proto::cluster::ClusterSummary) -> String {
    format!(
        "cluster {} as {}: {}  members {}  membership age {:.1}s  in force {}  refused hints {}{}\n",
        c.name,
        c.node_id,
        c.state.as_str(),
        c.members,
        c.membership_age_s,
        c.in_force,
        c.refused_hints,
        c.last_error
            .as_deref()
            .map_or_else(String::new, |e| format!("  last error: {e}"))
    )
}

/// The lines above the tables: daemon, GPU, client regions, cluster.
fn header(s: &StatsReport) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "kvnode {}  pid {}  up {:.0}s  clients {}",
        s.version, s.pid, s.uptime_s, s.clients
    );
    let g = &s.gpu;
    let _ = writeln!(
        o,
        "gpu: {}  registered {}  attached {}  offloaded {}  onloaded {}",
        g.driver,
        ByteSize(g.registered_bytes),
        g.attached,
        ByteSize(g.offload_bytes),
        ByteSize(g.onload_bytes)
    );
    let r = &s.regions;
    let _ = writeln!(
        o,
        "client regions attached: sealed {}  guarded {}  pread {}  faults {}",
        r.attached_sealed, r.attached_guarded, r.attached_pread, r.faults
    );
    if let Some(c) = &s.cluster {
        o.push_str(&cluster_line(c));
    }
    o
}

pub fn render(s: &StatsReport) -> String {
    let mut o = header(s);
    let _ = writeln!(
        o,
        "\n{:<6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10} {:>8} {:>10} {:>10}",
        "tier",
        "capacity",
        "blocks",
        "bytes",
        "hits",
        "misses",
        "hit%",
        "evictions",
        "leases",
        "pinned",
        "populated"
    );
    for t in &s.tiers {
        let _ = writeln!(
            o,
            "{:<6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10} {:>8} {:>10} {:>10}{}",
            t.tier,
            ByteSize(t.capacity_bytes).to_string(),
            t.blocks,
            ByteSize(t.bytes).to_string(),
            t.hits,
            t.misses,
            rate(t.hits, t.misses),
            t.evictions,
            t.leases,
            ByteSize(t.pinned_bytes).to_string(),
            ByteSize(t.populated_bytes).to_string(),
            if t.pin_refused {
                "  (pinning refused: RLIMIT_MEMLOCK)"
            } else {
                ""
            }
        );
    }
    render_movement(&mut o, s);
    let _ = writeln!(
        o,
        "\n{:<6} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>10}",
        "class", "slot", "slabs", "slots", "used", "resv", "free", "evictions"
    );
    for p in &s.pools {
        let _ = writeln!(
            o,
            "{:<6} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>10}",
            p.class,
            ByteSize(p.slot_bytes).to_string(),
            p.slabs,
            p.slots,
            p.used,
            p.reserved,
            p.free,
            p.evictions
        );
    }
    render_namespaces(&mut o, s);
    o
}

/// Per namespace, then per tenant.
fn render_namespaces(o: &mut String, s: &StatsReport) {
    let _ = writeln!(
        o,
        "\n{:<4} {:<16} {:<20} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "ns", "id", "model", "blocks", "bytes", "hits", "misses", "hit%", "evictions"
    );
    for n in &s.namespaces {
        let _ = writeln!(
            o,
            "{:<4} {:<16} {:<20} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}",
            n.ns,
            &n.id[..16.min(n.id.len())],
            n.model,
            n.blocks,
            ByteSize(n.bytes).to_string(),
            n.hits,
            n.misses,
            rate(n.hits, n.misses),
            n.evictions
        );
    }
    render_tenants(o, s);
    render_peers(o, s);
}

/// The connection count per peer and its basis; per peer: UCX GETs, slots served and
/// fallbacks to TCP (only peers seen).
fn render_peers(o: &mut String, s: &StatsReport) {
    let _ = writeln!(
        o,
        "\npeer connections per peer: {} ({})",
        s.peer_connections, s.peer_connections_basis
    );
    if s.peer.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\n{:<32} {:>12} {:>12} {:>10}",
        "peer", "ucx gets", "slots served", "fallbacks"
    );
    for p in &s.peer {
        let _ = writeln!(
            o,
            "{:<32} {:>12} {:>12} {:>10}",
            p.peer,
            p.peer_ucx_gets_total,
            p.peer_ucx_slots_served_total,
            p.peer_ucx_fallbacks_total
        );
    }
}

/// Per tenant: usage against quota in each tier, quota evictions and refusals, and the
/// connections refused at accept.
fn render_tenants(o: &mut String, s: &StatsReport) {
    let quota = |q: u64| {
        if q == 0 {
            "-".to_owned()
        } else {
            ByteSize(q).to_string()
        }
    };
    let _ = writeln!(
        o,
        "\n{:<16} {:>4} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>5}",
        "tenant",
        "ns",
        "dram",
        "dram quota",
        "nvme",
        "nvme quota",
        "evict dr",
        "evict nv",
        "refused",
        "arena"
    );
    for t in &s.tenants {
        let _ = writeln!(
            o,
            "{:<16} {:>4} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>5}",
            t.name,
            t.namespaces,
            ByteSize(t.dram_bytes).to_string(),
            quota(t.dram_quota),
            ByteSize(t.nvme_bytes).to_string(),
            quota(t.nvme_quota),
            t.dram_quota_evictions,
            t.nvme_quota_evictions,
            t.quota_refusals,
            if t.share_arena { "yes" } else { "no" }
        );
    }
    let r = &s.refused;
    let _ = writeln!(
        o,
        "clients refused at accept: allowlist {}, unmapped {}, no credentials {}, pre-Hello cap {}, connection cap {}",
        r.allowlist, r.unmapped, r.no_credentials, r.pre_hello, r.connections
    );
    render_limits(o, s);
}

/// Per tenant: connections, regions and leased blocks held now against the per-uid caps,
/// and how many were refused at those caps.
fn render_limits(o: &mut String, s: &StatsReport) {
    let _ = writeln!(
        o,
        "\n{:<16} {:>11} {:>8} {:>8} {:>11} {:>8} {:>8} {:>13} {:>9} {:>8}",
        "tenant (caps)",
        "connections",
        "cap/uid",
        "refused",
        "regions",
        "cap/uid",
        "refused",
        "leased blocks",
        "cap/uid",
        "refused"
    );
    for t in &s.tenants {
        let _ = writeln!(
            o,
            "{:<16} {:>11} {:>8} {:>8} {:>11} {:>8} {:>8} {:>13} {:>9} {:>8}",
            t.name,
            t.connections,
            t.connections_per_uid,
            t.refused_connections,
            t.regions,
            t.regions_per_uid,
            t.refused_regions,
            t.leased_blocks,
            t.leased_blocks_per_uid,
            t.refused_leases
        );
    }
}

/// Per-tier movement and health: demotions, promotions, drops, errors, IO queue, poisoning.
fn render_movement(o: &mut String, s: &StatsReport) {
    let _ = writeln!(
        o,
        "\n{:<6} {:>10} {:>10} {:>8} {:>8} {:>8} {:>9} {:>10} {:>8}",
        "tier",
        "demotions",
        "promotions",
        "dropped",
        "errors",
        "corrupt",
        "in-flight",
        "queue",
        "oldest"
    );
    for t in &s.tiers {
        let _ = writeln!(
            o,
            "{:<6} {:>10} {:>10} {:>8} {:>8} {:>8} {:>9} {:>10} {:>6}ms{}",
            t.tier,
            t.demotions,
            t.promotions,
            t.dropped,
            t.errors,
            t.corrupt,
            t.in_flight,
            t.queue_depth,
            t.oldest_queued_ms,
            t.poisoned
                .as_ref()
                .map_or(String::new(), |r| format!("  POISONED: {r}"))
        );
    }
    render_retention(o, s);
    render_router(o, s);
    render_costs(o, s);
}

/// The live cost model's figures and the fetch plans answered, once a path was measured.
fn render_costs(o: &mut String, s: &StatsReport) {
    if s.costs.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\n{:<32} {:>10} {:>12} {:>8} {:>8}",
        "path", "fixed", "rate", "ops", "age"
    );
    for c in &s.costs {
        let _ = writeln!(
            o,
            "{:<32} {:>8.3}ms {:>8.2}GB/s {:>8} {:>7.0}s",
            c.path,
            c.fixed_s * 1e3,
            c.bytes_per_s / 1e9,
            c.samples,
            c.age_s
        );
    }
    let p = &s.plans;
    let _ = writeln!(
        o,
        "fetch plans: all {}  slower {}  probe {}  nothing {}  keys fetch {} recompute {}  pulls skipped {}",
        p.all, p.slower, p.probe, p.nothing, p.keys_fetch, p.keys_recompute, p.pulls_skipped
    );
}

/// Blocks held by `kv.retain` (DRAM), once any hold was ever asked for.
fn render_retention(o: &mut String, s: &StatsReport) {
    let asked = |t: &kvnode_proto::stats::TierStats| {
        t.retained_blocks + t.retain_refused + t.retain_expired > 0
    };
    if !s.tiers.iter().any(asked) {
        return;
    }
    let _ = writeln!(
        o,
        "\n{:<6} {:>10} {:>10} {:>10} {:>10}",
        "tier", "retained", "ret-bytes", "refused", "expired"
    );
    for t in s.tiers.iter().filter(|t| asked(t)) {
        let _ = writeln!(
            o,
            "{:<6} {:>10} {:>10} {:>10} {:>10}",
            t.tier,
            t.retained_blocks,
            ByteSize(t.retained_bytes).to_string(),
            t.retain_refused,
            t.retain_expired
        );
    }
}

/// The router entry's requests, and router hashes resolved for peers, once there are any.
fn render_router(o: &mut String, s: &StatsReport) {
    let r = &s.router;
    if !r.serving && r.resolve_asked == 0 {
        return;
    }
    let _ = writeln!(
        o,
        "
router entry: {}  accepted {}  refused: auth {} replay {} invalid {}  resolved for peers {} of {} hashes",
        if r.serving { "serving" } else { "off" },
        r.accepted,
        r.refused_auth,
        r.refused_replay,
        r.refused_invalid,
        r.resolve_found,
        r.resolve_asked
    );
}

pub use kvnode_client::report::render_timeouts;
