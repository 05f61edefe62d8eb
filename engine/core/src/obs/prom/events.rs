//! `kvnode_events_*`: the KV event publisher's traffic, drops, and the memory it holds (the
//! queue and the replay ring, in total and per publishing tenant).

use std::fmt;

use kvnode_proto::stats::EventsStats;
use prometheus_client::metrics::MetricType;

use super::{Out, counter_at, gauge_at};

/// Every family, only when the daemon publishes events.
pub(super) fn events(o: &mut Out<'_>, e: &EventsStats) -> fmt::Result {
    o.counter(
        "events_published",
        "KV events published in a batch.",
        e.published,
    )?;
    o.counter(
        "events_bytes",
        "Payload bytes of KV event batches published.",
        e.bytes,
    )?;
    let mut f = o.family(
        "events_dropped",
        MetricType::Counter,
        "KV events dropped before publication, by cause: queue_full (event or byte bound), tenant_budget (the tenant's share), closed.",
    )?;
    for (cause, v) in [
        ("queue_full", e.dropped_queue_full),
        ("tenant_budget", e.dropped_tenant_budget),
        ("closed", e.dropped_closed),
    ] {
        counter_at(&mut f, &[("cause", cause)], v)?;
    }
    o.counter(
        "events_withheld",
        "Stores not announced because their tenant does not publish events (publish_events).",
        e.withheld,
    )?;
    o.gauge(
        "events_queued_bytes",
        "Bytes of KV events waiting for the publisher.",
        e.queued_bytes,
    )?;
    o.gauge(
        "events_replay_ring_bytes",
        "Payload bytes kept for KV event replay (0 without a replay endpoint).",
        e.replay_ring_bytes,
    )?;
    o.counter(
        "events_replay_ring_evicted",
        "Batches evicted from the replay ring to keep it within its bounds.",
        e.replay_ring_evicted,
    )?;
    o.counter(
        "events_snapshots",
        "Residency snapshots sent to event subscribers (asked for, or filling a replay hole).",
        e.snapshots,
    )?;
    o.counter(
        "events_snapshot_blocks",
        "Blocks (one per medium) carried by residency snapshots.",
        e.snapshot_blocks,
    )?;
    let mut f = o.family(
        "events_tenant_bytes",
        MetricType::Gauge,
        "Bytes of a publishing tenant's KV events, by where they wait (queue, replay_ring).",
    )?;
    for t in &e.tenants {
        let name = t.name.as_str();
        gauge_at(&mut f, &[("tenant", name), ("in", "queue")], t.queued_bytes)?;
        gauge_at(
            &mut f,
            &[("tenant", name), ("in", "replay_ring")],
            t.replay_ring_bytes,
        )?;
    }
    let mut f = o.family(
        "events_tenant_dropped",
        MetricType::Counter,
        "A publishing tenant's stores dropped because its share of the KV event queue was full.",
    )?;
    for t in &e.tenants {
        counter_at(&mut f, &[("tenant", t.name.as_str())], t.dropped)?;
    }
    Ok(())
}
