//! `kvnode_router_*`: the router entry's requests by outcome, and the router hashes peers
//! asked this daemon to resolve (docs/router-entry.md).

use std::fmt;

use kvnode_proto::stats::RouterStats;
use prometheus_client::metrics::MetricType;

use super::{Out, counter_at};

/// Both families (zero without the entry, or when no peer resolved anything here).
pub(super) fn router(o: &mut Out<'_>, r: &RouterStats) -> fmt::Result {
    let mut f = o.family(
        "router_requests",
        MetricType::Counter,
        "Router entry requests, by outcome: accepted, refused_auth (signature, key id, headers), refused_replay (timestamp window, replay, busy), refused_invalid (body, envelope, model).",
    )?;
    for (outcome, v) in [
        ("accepted", r.accepted),
        ("refused_auth", r.refused_auth),
        ("refused_replay", r.refused_replay),
        ("refused_invalid", r.refused_invalid),
    ] {
        counter_at(&mut f, &[("outcome", outcome)], v)?;
    }
    let mut f = o.family(
        "router_resolve_hashes",
        MetricType::Counter,
        "Router hashes peers asked this daemon to resolve (peer Resolve), by whether they named a page it announced.",
    )?;
    counter_at(&mut f, &[("found", "true")], r.resolve_found)?;
    counter_at(
        &mut f,
        &[("found", "false")],
        r.resolve_asked.saturating_sub(r.resolve_found),
    )
}
