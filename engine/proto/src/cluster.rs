//! Cluster membership as the daemon reports it (`cluster` op, `stats`, `/metrics`);
//! docs/cluster.md says where it comes from (etcd) and what each state means.

use serde::{Deserialize, Serialize};

/// Where this daemon stands with the cluster's membership store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    /// etcd has not answered since start: no member is known, membership authorizes nothing.
    #[default]
    Connecting,
    /// Registered, lease kept alive, watch running: membership is current.
    Healthy,
    /// etcd stopped answering; the last known membership is in force until the grace ends.
    Degraded,
    /// etcd unreachable for longer than the grace: membership authorizes nothing until etcd
    /// answers again (static `--peers` still apply).
    Expired,
}

impl ClusterState {
    /// Lower-case name (logs, tables).
    pub fn as_str(self) -> &'static str {
        match self {
            ClusterState::Connecting => "connecting",
            ClusterState::Healthy => "healthy",
            ClusterState::Degraded => "degraded",
            ClusterState::Expired => "expired",
        }
    }
}

/// One line of cluster health (`stats`, `/metrics`, `cluster status`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterSummary {
    /// Cluster name (the etcd URL's path).
    pub name: String,
    /// This daemon's node id.
    pub node_id: String,
    /// etcd endpoints as configured.
    pub etcd: Vec<String>,
    /// See [`ClusterState`].
    pub state: ClusterState,
    /// Whether etcd answers right now.
    pub etcd_healthy: bool,
    /// Whether this daemon's own record is registered under a live lease.
    pub registered: bool,
    /// Live members known (this daemon included).
    pub members: u32,
    /// Members whose peer protocol version differs from this daemon's (hints to them are
    /// refused).
    pub incompatible_members: u32,
    /// Seconds since etcd last confirmed the membership (a keep-alive or watch answer).
    pub membership_age_s: f64,
    /// Whether membership currently authorizes hints (healthy, or degraded within the grace).
    pub in_force: bool,
    /// Seconds since etcd stopped answering (degraded or expired), else `None`.
    pub unreachable_for_s: Option<f64>,
    /// Configured lease time-to-live, seconds.
    pub ttl_s: u64,
    /// Configured grace after etcd stops answering, seconds.
    pub grace_s: f64,
    /// Sessions with etcd started after the first (reconnects and re-registrations).
    pub reconnects: u64,
    /// Hints refused because membership did not authorize their endpoint.
    pub refused_hints: u64,
    /// The last etcd failure, if any since the last healthy session started.
    pub last_error: Option<String>,
}

/// Capacity of one tier of a member.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberTier {
    /// `dram` or `nvme`.
    pub tier: String,
    /// Bytes.
    pub capacity_bytes: u64,
}

/// One live member as this daemon sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberReport {
    /// Node id (unique in the cluster).
    pub node_id: String,
    /// Advertised peer endpoints (`tcp://host:port`, ...).
    pub endpoints: Vec<String>,
    /// Transports it serves (`tcp`, ...).
    pub transports: Vec<String>,
    /// Software version.
    pub version: String,
    /// Peer protocol version it speaks.
    pub peer_protocol: u32,
    /// Whether hints to it can be honoured (same peer protocol and cluster key id).
    pub compatible: bool,
    /// Identifier of its cluster key (a keyed digest; never the key).
    pub key_id: Option<String>,
    /// Tier capacities.
    pub tiers: Vec<MemberTier>,
    /// Seconds since it registered under its current lease (its own clock).
    pub lease_age_s: f64,
    /// Seconds since this daemon saw its current record.
    pub seen_s: f64,
    /// Whether this is the answering daemon.
    pub this_node: bool,
}

/// The `cluster` op's answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterReport {
    /// Health.
    pub summary: ClusterSummary,
    /// Live members, by node id.
    pub members: Vec<MemberReport>,
}
