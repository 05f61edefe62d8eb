//! The statistics report returned by `stats`.

use serde::{Deserialize, Serialize};

/// Everything `kvnode stats` prints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatsReport {
    /// Daemon build.
    pub version: String,
    /// Daemon pid.
    pub pid: u32,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Connected clients.
    pub clients: u32,
    /// One entry per tier (`dram`, later `nvme`).
    pub tiers: Vec<TierStats>,
    /// One entry per slot class.
    pub pools: Vec<PoolStats>,
    /// One entry per registered namespace.
    pub namespaces: Vec<NamespaceStats>,
    /// GPU path (driver state, registered arena bytes, copies).
    pub gpu: crate::gpu::GpuStats,
    /// Client regions (`AttachRegion`) by copy mode, and faults absorbed.
    pub regions: RegionStats,
    /// Cluster membership health, when the daemon runs with `--cluster`.
    pub cluster: Option<crate::cluster::ClusterSummary>,
    /// One entry per tenant (one, `default`, without a tenant map). A client of a tenant
    /// sees its own row only; root and the daemon's own uid see every row.
    pub tenants: Vec<TenantStats>,
    /// Client connections refused at accept.
    pub refused: RefusedStats,
    /// Peer transport counters, one entry per peer seen (pulled from, or served).
    pub peer: Vec<PeerStats>,
    /// Connections a pull from one peer is striped over.
    pub peer_connections: u32,
    /// Why: `configured`, or the automatic choice's basis (cores, fastest link).
    pub peer_connections_basis: String,
    /// KV events, when the daemon publishes them (`--events`).
    pub events: Option<EventsStats>,
    /// The router entry (`--router-listen`) and router-hash resolution for peers.
    pub router: RouterStats,
    /// Each path's measured cost (fixed + rate), from what the daemon moved.
    #[serde(default)]
    pub costs: Vec<crate::plan::PathCost>,
    /// Fetch plans answered.
    #[serde(default)]
    pub plans: crate::plan::PlanStats,
    /// The spill tier's index is being rebuilt (a start or takeover on a spill directory):
    /// DRAM serves alone and blocks only on NVMe are misses until it is done.
    #[serde(default)]
    pub spill_recovering: bool,
}

/// Router entry counters (`/metrics`: `kvnode_router_*`; docs/router-entry.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterStats {
    /// Whether the router entry is serving.
    pub serving: bool,
    /// Requests authenticated and run.
    pub accepted: u64,
    /// Requests refused for their signature: missing headers, unknown key id, bad signature.
    pub refused_auth: u64,
    /// Requests refused for their timing: a timestamp outside the window, a replay, or too
    /// many requests within the window.
    pub refused_replay: u64,
    /// Authenticated requests refused for their content (bad body or envelope, no namespace
    /// of the model).
    pub refused_invalid: u64,
    /// Router hashes peers asked this daemon to resolve (peer `Resolve`).
    pub resolve_asked: u64,
    /// Of those, hashes that named a page this daemon announced.
    pub resolve_found: u64,
}

/// KV event publisher counters (`/metrics`: `kvnode_events_*`; docs/events.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventsStats {
    /// Events published in a batch.
    pub published: u64,
    /// Batches published.
    pub batches: u64,
    /// Payload bytes published.
    pub bytes: u64,
    /// Events dropped because the queue to the publisher was at its event or byte bound.
    pub dropped_queue_full: u64,
    /// Stores dropped because their tenant's share of the queue was full.
    pub dropped_tenant_budget: u64,
    /// Events submitted after the publisher shut down.
    pub dropped_closed: u64,
    /// Events refused before batching (they would break the router's parser).
    pub rejected: u64,
    /// Stores not announced because their tenant does not publish events.
    pub withheld: u64,
    /// Bytes of events waiting for the publisher now.
    pub queued_bytes: u64,
    /// Payload bytes kept for replay now (0 without a replay endpoint).
    pub replay_ring_bytes: u64,
    /// Batches kept for replay now.
    pub replay_ring_batches: u64,
    /// Batches evicted from the replay ring to keep it within its bounds.
    pub replay_ring_evicted: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Replay requests ignored because their framing was wrong.
    pub replay_bad_requests: u64,
    /// Residency snapshots sent (asked for, or filling a replay the ring could not cover).
    pub snapshots: u64,
    /// Blocks (one per medium) those snapshots carried.
    pub snapshot_blocks: u64,
    /// One entry per tenant that publishes events (none without a tenant map).
    pub tenants: Vec<EventsTenantStats>,
}

/// One publishing tenant's share of the publisher's memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventsTenantStats {
    /// Tenant name.
    pub name: String,
    /// Bytes it may hold queued, and again in the replay ring.
    pub limit_bytes: u64,
    /// Bytes of its events queued now.
    pub queued_bytes: u64,
    /// Bytes of its events kept for replay now.
    pub replay_ring_bytes: u64,
    /// Its stores dropped because its share was full.
    pub dropped: u64,
}

/// UCX counters of one peer (`/metrics`: the same names with a `kvnode_` prefix and a
/// `peer` label). A peer this daemon pulls from is named as dialled (`tcp://host:port`); a
/// destination it serves, by the identity its handshake gave (its advertised endpoint).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PeerStats {
    /// The peer.
    pub peer: String,
    /// Blocks this daemon read from the peer with UCX GETs (landed and settled).
    pub peer_ucx_gets_total: u64,
    /// Blocks this daemon answered the peer with a UCX `Slot` (for the peer's GET).
    pub peer_ucx_slots_served_total: u64,
    /// Connections to the peer that this daemon wanted on UCX and that pull over TCP
    /// instead (the peer declined, or no UCX endpoint to it could be opened).
    pub peer_ucx_fallbacks_total: u64,
}

/// Usage and quota of one tenant (`[[tenants.tenant]]`, docs/operations.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantStats {
    /// Tenant name.
    pub name: String,
    /// Namespaces registered by the tenant's clients.
    pub namespaces: u32,
    /// Bytes of the tenant's blocks in DRAM.
    pub dram_bytes: u64,
    /// DRAM quota in bytes (0: none).
    pub dram_quota: u64,
    /// Bytes of the tenant's blocks on NVMe (written since start).
    pub nvme_bytes: u64,
    /// NVMe quota in bytes (0: none).
    pub nvme_quota: u64,
    /// Own DRAM blocks evicted to stay within the DRAM quota.
    pub dram_quota_evictions: u64,
    /// Own NVMe blocks dropped to stay within the NVMe quota.
    pub nvme_quota_evictions: u64,
    /// Keys refused `NoSpace` because the quota was reached and nothing of the tenant's
    /// could be evicted (all leased or reserved).
    pub quota_refusals: u64,
    /// Whether the tenant's clients get the arena mapping.
    pub share_arena: bool,
    /// Client connections of the tenant's uids open now.
    pub connections: u64,
    /// Regions and GPU buffers its clients have attached now.
    pub regions: u64,
    /// Blocks its clients hold leased now.
    pub leased_blocks: u64,
    /// Connections refused at accept: the uid was at `connections_per_uid`.
    pub refused_connections: u64,
    /// Attaches refused: the uid was at `regions_per_uid`.
    pub refused_regions: u64,
    /// Holding requests refused: the uid would pass `leased_blocks_per_uid`.
    pub refused_leases: u64,
    /// Its per-uid caps in force (`[tenants.limits]`, docs/operations.md).
    pub connections_per_uid: u32,
    /// See `connections_per_uid`.
    pub regions_per_uid: u32,
    /// See `connections_per_uid`.
    pub leased_blocks_per_uid: u64,
}

/// Connections refused at accept, by reason, and requests refused at a per-uid cap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RefusedStats {
    /// uid and gid outside `allow_uids` / `allow_gids`.
    pub allowlist: u64,
    /// No tenant maps the identity and `[tenants] unmapped = "refuse"`.
    pub unmapped: u64,
    /// `SO_PEERCRED` could not be read while an allowlist or tenant map is in force.
    pub no_credentials: u64,
    /// The uid already had `max_pre_hello_per_uid` connections waiting for their `Hello`.
    pub pre_hello: u64,
    /// The uid already had `connections_per_uid` connections open.
    pub connections: u64,
    /// Attaches refused (not connections): the uid was at `regions_per_uid`.
    pub regions: u64,
    /// Holding requests refused (not connections): the uid would pass
    /// `leased_blocks_per_uid`.
    pub leased_blocks: u64,
}

/// Counters of one tier.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierStats {
    /// Tier name.
    pub tier: String,
    /// Bytes the tier can hold.
    pub capacity_bytes: u64,
    /// Resident blocks.
    pub blocks: u64,
    /// Bytes of resident blocks.
    pub bytes: u64,
    /// Bytes of slots in use (blocks, reservations), including slot rounding.
    pub slot_bytes: u64,
    /// Keys found by `get`.
    pub hits: u64,
    /// Keys not found by `get`.
    pub misses: u64,
    /// Blocks stored.
    pub inserts: u64,
    /// Blocks evicted to make room.
    pub evictions: u64,
    /// Leases currently held (per block).
    pub leases: u64,
    /// Slots reserved by `alloc` and not yet committed.
    pub reserved: u64,
    /// Bytes locked in memory (DRAM only).
    pub pinned_bytes: u64,
    /// Bytes already faulted in (DRAM only).
    pub populated_bytes: u64,
    /// Whether pinning was refused (RLIMIT_MEMLOCK) and the tier runs unpinned.
    pub pin_refused: bool,
    /// Blocks moved down to the next tier (DRAM -> NVMe).
    pub demotions: u64,
    /// Blocks copied up into DRAM from the next tier on a `get`.
    pub promotions: u64,
    /// DRAM: blocks refreshed in the eviction policy by `Touch` (an engine's GPU hits).
    pub touched: u64,
    /// DRAM: blocks evicted with no copy below (demotion lagged, not admitted, or no spill).
    /// NVMe: not used.
    pub dropped: u64,
    /// Failed transfers (write/read errors, refused submissions).
    pub errors: u64,
    /// Operations queued to the tier's IO and not completed (NVMe).
    pub queue_depth: u64,
    /// Age of the oldest such operation in milliseconds (stalled offload shows here).
    pub oldest_queued_ms: u64,
    /// Demotions started and not finished (DRAM).
    pub in_flight: u64,
    /// Why the tier refuses writes, if it is poisoned (NVMe).
    pub poisoned: Option<String>,
    /// Reads whose bytes failed verification and were served as misses (NVMe).
    pub corrupt: u64,
    /// Blocks copied down while kept in DRAM: write-behind and the stop-time flush (NVMe).
    pub copied_down: u64,
    /// Times the oldest block waiting for write-behind was older than `spill.lag` (NVMe).
    pub lag_exceeded: u64,
    /// Delete and clear markers written to the spill log, one per file for each delete
    /// or clear, so that it survives a restart (NVMe).
    pub delete_markers: u64,
    /// Blocks found on disk at start-up that a delete or clear made before the restart
    /// ended; not served (NVMe).
    pub recovered_deleted: u64,
    /// Blocks held by `kv.retain` now (DRAM).
    pub retained_blocks: u64,
    /// Bytes of those blocks (DRAM).
    pub retained_bytes: u64,
    /// Keys a `kv.retain` refused because their tenant's retained quota was full (DRAM).
    pub retain_refused: u64,
    /// Holds that ended because their time ran out (DRAM).
    pub retain_expired: u64,
}

/// Counters of one slot class.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolStats {
    /// Class index.
    pub class: u32,
    /// Slot size in bytes.
    pub slot_bytes: u64,
    /// Slabs owned.
    pub slabs: u32,
    /// Slots in owned slabs.
    pub slots: u64,
    /// Slots holding committed blocks.
    pub used: u64,
    /// Slots reserved by writers.
    pub reserved: u64,
    /// Free slots.
    pub free: u64,
    /// Evictions from this class.
    pub evictions: u64,
}

/// Counters of one namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NamespaceStats {
    /// Handle.
    pub ns: u32,
    /// 128-bit id, hex.
    pub id: String,
    /// Model from the spec.
    pub model: String,
    /// Resident blocks.
    pub blocks: u64,
    /// Bytes of resident blocks.
    pub bytes: u64,
    /// `get` hits.
    pub hits: u64,
    /// `get` misses.
    pub misses: u64,
    /// Blocks stored.
    pub inserts: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks removed by delete or clear.
    pub removed: u64,
    /// Blocks held by `kv.retain` now.
    pub retained_blocks: u64,
    /// Bytes of those blocks.
    pub retained_bytes: u64,
}

/// Client regions attached since start, by how the daemon copies them (docs/sglang.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionStats {
    /// Sealed against shrinking (`MFD_ALLOW_SEALING`): memcpy through the mapping.
    pub attached_sealed: u64,
    /// Unsealable: memcpy through the mapping under the SIGBUS guard.
    pub attached_guarded: u64,
    /// pread/pwrite on the descriptor (guard off or mapping impossible).
    pub attached_pread: u64,
    /// Copies that faulted because a client shrank its file (op failed, region detached).
    pub faults: u64,
}
