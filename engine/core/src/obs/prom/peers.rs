//! Per-peer UCX counters: `kvnode_peer_ucx_gets_total`, `kvnode_peer_ucx_slots_served_total`
//! and `kvnode_peer_ucx_fallbacks_total`, each with a `peer` label (the same figures as
//! `stats.peer` of `kvnode stats --json`).

use std::fmt;

use kvnode_proto::stats::StatsReport;
use prometheus_client::metrics::MetricType;

use super::{Out, counter_at};

pub(super) fn peers(o: &mut Out<'_>, s: &StatsReport) -> fmt::Result {
    type Pick = fn(&kvnode_proto::stats::PeerStats) -> u64;
    let families: [(&'static str, &str, Pick); 3] = [
        (
            "peer_ucx_gets",
            "Blocks read from a peer with UCX GETs.",
            |p| p.peer_ucx_gets_total,
        ),
        (
            "peer_ucx_slots_served",
            "Blocks answered to a peer as UCX Slots (read by its GETs).",
            |p| p.peer_ucx_slots_served_total,
        ),
        (
            "peer_ucx_fallbacks",
            "Connections to a peer wanted on UCX that pull over TCP instead.",
            |p| p.peer_ucx_fallbacks_total,
        ),
    ];
    for (name, help, pick) in families {
        let mut f = o.family(name, MetricType::Counter, help)?;
        for p in &s.peer {
            counter_at(&mut f, &[("peer", p.peer.as_str())], pick(p))?;
        }
    }
    Ok(())
}
