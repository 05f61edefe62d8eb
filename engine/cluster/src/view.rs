//! The live membership as this daemon knows it: written by the agent from etcd, read by the
//! hint path. Reads take a read lock over a map lookup and never wait on etcd.
//!
//! States (docs/cluster.md, "Failure semantics"):
//!
//! ```text
//!  Connecting ──first listing──> Healthy ──etcd stops answering──> Degraded ──grace──> Expired
//!      ^                            ^  └──────────────<── etcd answers again ──────────────┘
//!      └ start (nothing authorized) └ re-registered, listing reloaded
//! ```

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvnode_proto::cluster::{ClusterReport, ClusterState, ClusterSummary, MemberReport};

use crate::record::{MemberRecord, endpoint_host_port};

/// What this daemon is, for comparing members with it.
#[derive(Clone, Debug)]
pub struct Local {
    /// Cluster name.
    pub name: String,
    /// etcd endpoints (for reports).
    pub etcd: Vec<String>,
    /// This daemon's node id.
    pub node_id: String,
    /// This daemon's peer protocol version.
    pub peer_protocol: u32,
    /// This daemon's cluster key id.
    pub key_id: Option<String>,
    /// Lease time-to-live, seconds.
    pub ttl_s: u64,
    /// Grace after etcd stops answering.
    pub grace: Duration,
}

/// What membership says of one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// A live, compatible member advertises it.
    Member(String),
    /// No live member advertises it.
    NotMember,
    /// etcd never answered since start: no member is known.
    NeverConfirmed,
    /// etcd has not answered for longer than the grace.
    Expired {
        /// Since etcd stopped answering.
        unreachable_for: Duration,
    },
    /// The member speaks another peer protocol version.
    Incompatible {
        /// Its node id.
        node_id: String,
        /// Its version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The member's cluster key differs from ours (its handshake would fail).
    KeyMismatch {
        /// Its node id.
        node_id: String,
    },
}

impl Verdict {
    /// Whether hints to the endpoint may be honoured.
    pub fn authorizes(&self) -> bool {
        matches!(self, Verdict::Member(_))
    }

    /// The refusal in words, for the client and the log.
    pub fn describe(&self, endpoint: &str) -> String {
        match self {
            Verdict::Member(id) => format!("{endpoint} is live cluster member {id}"),
            Verdict::NotMember => {
                format!("{endpoint} is not a live cluster member (not in --peers either)")
            }
            Verdict::NeverConfirmed => format!(
                "{endpoint} cannot be checked: etcd has not answered since this daemon started"
            ),
            Verdict::Expired { unreachable_for } => format!(
                "{endpoint} cannot be checked: etcd unreachable for {:.1}s, past the membership grace",
                unreachable_for.as_secs_f64()
            ),
            Verdict::Incompatible {
                node_id,
                theirs,
                ours,
            } => format!(
                "{endpoint} is cluster member {node_id} speaking peer protocol v{theirs}, this daemon v{ours}: not pulled (upgrade one side)"
            ),
            Verdict::KeyMismatch { node_id } => format!(
                "{endpoint} is cluster member {node_id} with a different cluster key id: its handshake would fail"
            ),
        }
    }
}

/// One live member.
#[derive(Clone, Debug)]
struct Member {
    record: MemberRecord,
    /// When this daemon saw this version of the record.
    seen: Instant,
}

#[derive(Clone, Copy, Debug)]
enum Health {
    Connecting,
    Healthy,
    Lost(Instant),
}

#[derive(Debug)]
struct Inner {
    members: HashMap<String, Member>,
    /// (host, port) -> node id of the member advertising it.
    endpoints: HashMap<(String, u16), String>,
    health: Health,
    confirmed_at: Option<Instant>,
    registered: bool,
    last_error: Option<String>,
}

/// How a record changed the membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A node id not seen before.
    Joined,
    /// Same node id, other endpoints (a restart at a new address).
    Moved {
        /// Its previous endpoints, no longer authorized.
        from: Vec<String>,
    },
    /// Same node id, new instance at the same endpoints (a restart).
    Restarted,
    /// Anything else (capacities, version).
    Updated,
}

/// The membership view. `Send + Sync`; one per daemon, shared by the agent and the hint path.
#[derive(Debug)]
pub struct View {
    local: Local,
    inner: RwLock<Inner>,
    reconnects: AtomicU64,
}

impl View {
    /// An empty view in state `Connecting`.
    pub fn new(local: Local) -> Self {
        Self {
            local,
            inner: RwLock::new(Inner {
                members: HashMap::new(),
                endpoints: HashMap::new(),
                health: Health::Connecting,
                confirmed_at: None,
                registered: false,
                last_error: None,
            }),
            reconnects: AtomicU64::new(0),
        }
    }

    /// What this daemon is.
    pub fn local(&self) -> &Local {
        &self.local
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What membership says of `host:port` now. Never waits on etcd.
    pub fn check(&self, host: &str, port: u16) -> Verdict {
        self.check_at(host, port, Instant::now())
    }

    fn check_at(&self, host: &str, port: u16, now: Instant) -> Verdict {
        let g = self.read();
        match g.health {
            Health::Connecting => return Verdict::NeverConfirmed,
            Health::Lost(since) if now.saturating_duration_since(since) > self.local.grace => {
                return Verdict::Expired {
                    unreachable_for: now.saturating_duration_since(since),
                };
            }
            Health::Healthy | Health::Lost(_) => {}
        }
        let Some(id) = g.endpoints.get(&(host.to_ascii_lowercase(), port)) else {
            return Verdict::NotMember;
        };
        let r = &g.members[id].record;
        if r.peer_protocol != self.local.peer_protocol {
            return Verdict::Incompatible {
                node_id: id.clone(),
                theirs: r.peer_protocol,
                ours: self.local.peer_protocol,
            };
        }
        if !keys_compatible(r.key_id.as_deref(), self.local.key_id.as_deref()) {
            return Verdict::KeyMismatch {
                node_id: id.clone(),
            };
        }
        Verdict::Member(id.clone())
    }

    /// While degraded: how long until the grace ends.
    pub fn grace_left(&self) -> Option<Duration> {
        match self.read().health {
            Health::Lost(since) => Some(self.local.grace.saturating_sub(since.elapsed())),
            _ => None,
        }
    }

    /// The state now.
    pub fn state(&self) -> ClusterState {
        state_of(self.read().health, self.local.grace, Instant::now())
    }

    /// Replaces the membership with a full listing and marks etcd healthy.
    pub fn reload(&self, records: Vec<MemberRecord>) {
        let now = Instant::now();
        let mut g = self.write();
        let old = std::mem::take(&mut g.members);
        g.endpoints.clear();
        for r in records {
            let seen = match old.get(&r.node_id) {
                Some(m) if m.record == r => m.seen,
                _ => now,
            };
            index(&mut g.endpoints, &r);
            g.members
                .insert(r.node_id.clone(), Member { record: r, seen });
        }
        g.health = Health::Healthy;
        g.confirmed_at = Some(now);
    }

    /// Adds or replaces one member's record (watch `PUT`).
    pub fn upsert(&self, r: MemberRecord) -> Change {
        let now = Instant::now();
        let mut g = self.write();
        let change = match g.members.get(&r.node_id) {
            None => Change::Joined,
            Some(m) if m.record.endpoints != r.endpoints => Change::Moved {
                from: m.record.endpoints.clone(),
            },
            Some(m) if m.record.instance != r.instance => Change::Restarted,
            Some(_) => Change::Updated,
        };
        if let Some(old) = g.members.remove(&r.node_id) {
            unindex(&mut g.endpoints, &old.record);
        }
        index(&mut g.endpoints, &r);
        g.members.insert(
            r.node_id.clone(),
            Member {
                record: r,
                seen: now,
            },
        );
        g.health = Health::Healthy;
        g.confirmed_at = Some(now);
        change
    }

    /// Removes one member (watch `DELETE`: lease expired or revoked). Returns its record.
    pub fn remove(&self, node_id: &str) -> Option<MemberRecord> {
        let mut g = self.write();
        let m = g.members.remove(node_id)?;
        unindex(&mut g.endpoints, &m.record);
        g.confirmed_at = Some(Instant::now());
        Some(m.record)
    }

    /// etcd answered (a keep-alive or a watch progress): the membership is current.
    pub fn confirm(&self) {
        let mut g = self.write();
        if !matches!(g.health, Health::Connecting) {
            g.health = Health::Healthy;
            g.confirmed_at = Some(Instant::now());
        }
    }

    /// etcd stopped answering. Returns true on the transition (healthy -> degraded).
    pub fn lost(&self, why: String) -> bool {
        let mut g = self.write();
        g.last_error = Some(why);
        g.registered = false;
        if matches!(g.health, Health::Healthy) {
            g.health = Health::Lost(Instant::now());
            return true;
        }
        false
    }

    /// Whether this daemon's own record is registered under a live lease.
    pub fn set_registered(&self, yes: bool) {
        let mut g = self.write();
        g.registered = yes;
        if yes {
            g.last_error = None;
        }
    }

    /// Counts one more etcd session after the first.
    pub fn count_reconnect(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// Live members known.
    pub fn len(&self) -> usize {
        self.read().members.len()
    }

    /// Whether no member is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Health in one line.
    pub fn summary(&self) -> ClusterSummary {
        let now = Instant::now();
        let g = self.read();
        let state = state_of(g.health, self.local.grace, now);
        ClusterSummary {
            name: self.local.name.clone(),
            node_id: self.local.node_id.clone(),
            etcd: self.local.etcd.clone(),
            state,
            etcd_healthy: matches!(g.health, Health::Healthy),
            registered: g.registered,
            members: g.members.len() as u32,
            incompatible_members: g
                .members
                .values()
                .filter(|m| m.record.peer_protocol != self.local.peer_protocol)
                .count() as u32,
            membership_age_s: g
                .confirmed_at
                .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
            in_force: matches!(state, ClusterState::Healthy | ClusterState::Degraded),
            unreachable_for_s: match g.health {
                Health::Lost(since) => Some(now.saturating_duration_since(since).as_secs_f64()),
                _ => None,
            },
            ttl_s: self.local.ttl_s,
            grace_s: self.local.grace.as_secs_f64(),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            refused_hints: 0,
            last_error: g.last_error.clone(),
        }
    }

    /// Health and every live member, by node id.
    pub fn report(&self) -> ClusterReport {
        let summary = self.summary();
        let now = Instant::now();
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let g = self.read();
        let mut members: Vec<MemberReport> = g
            .members
            .values()
            .map(|m| {
                let r = &m.record;
                MemberReport {
                    node_id: r.node_id.clone(),
                    endpoints: r.endpoints.clone(),
                    transports: r.transports.clone(),
                    version: r.version.clone(),
                    peer_protocol: r.peer_protocol,
                    compatible: r.peer_protocol == self.local.peer_protocol
                        && keys_compatible(r.key_id.as_deref(), self.local.key_id.as_deref()),
                    key_id: r.key_id.clone(),
                    tiers: r.tiers.clone(),
                    lease_age_s: wall_ms.saturating_sub(r.registered_unix_ms) as f64 / 1e3,
                    seen_s: now.saturating_duration_since(m.seen).as_secs_f64(),
                    this_node: r.node_id == self.local.node_id,
                }
            })
            .collect();
        members.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        ClusterReport { summary, members }
    }
}

fn state_of(h: Health, grace: Duration, now: Instant) -> ClusterState {
    match h {
        Health::Connecting => ClusterState::Connecting,
        Health::Healthy => ClusterState::Healthy,
        Health::Lost(since) if now.saturating_duration_since(since) > grace => {
            ClusterState::Expired
        }
        Health::Lost(_) => ClusterState::Degraded,
    }
}

fn index(ix: &mut HashMap<(String, u16), String>, r: &MemberRecord) {
    for e in &r.endpoints {
        if let Some(hp) = endpoint_host_port(e) {
            ix.insert(hp, r.node_id.clone());
        }
    }
}

fn unindex(ix: &mut HashMap<(String, u16), String>, r: &MemberRecord) {
    for e in &r.endpoints {
        if let Some(hp) = endpoint_host_port(e)
            && ix.get(&hp) == Some(&r.node_id)
        {
            ix.remove(&hp);
        }
    }
}

#[cfg(test)]
mod tests;

/// Whether two members' key ids admit a handshake. A key id lists the ids of the keys a
/// member held when it registered, comma-separated (two during a key roll); they must share
/// one. A member without an id (keyless, or an older record) is not judged here: the
/// handshake decides.
pub fn keys_compatible(theirs: Option<&str>, ours: Option<&str>) -> bool {
    match (theirs, ours) {
        (Some(a), Some(b)) => a.split(',').any(|x| b.split(',').any(|y| x == y)),
        _ => true,
    }
}
