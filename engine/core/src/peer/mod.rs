//! Peer pulls: router-hinted transfers of blocks between daemons (docs/peer-protocol.md).
//!
//! ```text
//!  client Get/Exists/Pull + hint ─> start (parse, match hashes, authorize: no dial before)
//!        └─> PullOp (per-key outcomes, deadline, fence) ─> fetch::run_chunk per connection
//!              └─> PullWire (blocking thread; TCP) ──Pull──> source::serve on the peer ──Block/Miss/Done──┘
//! ```
//!
//! - [`config`]: `[peer]` settings and the allowlist.
//! - [`membership`]: the seam through which cluster membership authorizes endpoints too.
//! - [`auth`]: cluster keys (two during a roll) and the handshake bound to both daemons.
//! - [`transport`]: the transport seam (TCP, fault-injecting), the sealed channel, and
//!   framed, time-bounded I/O.
//! - [`hashes`]: content hashes of sent and pulled blocks (hashed once).
//! - [`source`]: answering pulls from the local tier.
//! - [`fetch`]: per-peer connection pools and pulling into reserved DRAM slots.
//! - [`op`]: operations, their outcomes and the buffer fence.
//! - [`fair`]: each tenant's fair share of a peer's cap on keys in flight.
//! - [`arrivals`]: following an op's leading keys as they land (for onward copies).
//! - [`timeouts`]: latency histograms and the declared timeout model.
//! - `trust`: the allowlist, the cluster keys and this daemon's identity; `wires`: the
//!   transport, the links to peers and the listener's address (the hub's two concerns).

pub mod arrivals;
pub mod auth;
/// The block MAC, its own crate (`kvnode-blockmac`); re-exported for the tests crate.
pub use kvnode_blockmac as block_mac;
pub mod config;
pub mod conns;
pub mod error;
pub mod fair;
pub mod fetch;
pub mod hashes;
pub mod join;
pub mod membership;
pub mod op;
mod report;
mod resolve;
pub mod source;
mod start;
pub use start::PullRequest;
pub mod timeouts;
pub mod transport;
mod trust;
mod wires;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ucx;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::pull::{FailCode, Failure};
use trust::Trust;
use wires::Wires;

pub use arrivals::Arrivals;
pub use auth::{ClusterKey, Identity, KeyRing};
pub use config::{Allowed, PeerConfig, TransportKind};
pub use error::{ConfigError, HandshakeError, PeerError, PullError, Violation, WireError};
pub use membership::Membership;
pub use op::{NewOp, OpTable, PullOp};
pub use timeouts::PullStats;

use crate::obs::Metrics;
use crate::store::Store;

/// Reserved owner ids of peer pulls live above this (client connections count from 1).
const PULL_OWNER_BASE: u64 = 1 << 62;

/// Counters of peer activity.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// Blocks pulled and committed.
    pub pulled_blocks: AtomicU64,
    /// Bytes of those blocks.
    pub pulled_bytes: AtomicU64,
    /// Failed chunks and corrupt blocks.
    pub failures: AtomicU64,
    /// Hints refused before any connection.
    pub refused_hints: AtomicU64,
    /// Of those, hints that cluster membership refused (not a live member, incompatible,
    /// membership expired).
    pub refused_members: AtomicU64,
    /// Blocks a source did not send because their bytes changed after they were hashed.
    pub changed_blocks: AtomicU64,
    /// Blocks this source answered with a UCX `Slot` (read by the destination's GET).
    pub ucx_slots_served: AtomicU64,
    /// The same, by destination identity (`stats.peer`).
    pub ucx_served_by: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Router hashes destinations asked this source to resolve (`Resolve`).
    pub resolve_asked: AtomicU64,
    /// Of those, hashes it resolved to a page it announced.
    pub resolve_found: AtomicU64,
}

impl PeerCounters {
    /// Counts one answered `Resolve`.
    pub fn resolved(&self, digests: &[Option<kvnode_proto::Digest>]) {
        let found = digests.iter().flatten().count() as u64;
        self.resolve_asked
            .fetch_add(digests.len() as u64, Ordering::Relaxed);
        self.resolve_found.fetch_add(found, Ordering::Relaxed);
    }
}

/// The peer service of one daemon: who may be pulled from ([`Trust`]), how peers are reached
/// ([`Wires`]), the operations, and what they measured.
#[derive(Debug)]
pub struct Peers {
    cfg: PeerConfig,
    /// Why `cfg.connections` is what it is (`configured`, or the automatic choice's basis).
    conns_basis: String,
    trust: Trust,
    wires: Wires,
    /// Cluster membership, when the daemon runs with one (set once at start-up).
    membership: OnceLock<Arc<dyn Membership>>,
    /// Content hashes of blocks sent and pulled.
    pub hashes: hashes::HashCache,
    /// Operations.
    pub ops: OpTable,
    /// The keys being pulled now, for later ops to join (join.rs).
    pub in_flight: join::KeysInFlight,
    /// Latency measurements.
    pub stats: PullStats,
    /// Counters.
    pub counters: PeerCounters,
    owners: AtomicU64,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
}

impl Peers {
    /// Builds the service from configuration (reads the cluster key file).
    pub fn new(
        cfg: &PeerConfig,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, PeerError> {
        cfg.validate()?;
        let choice = conns::choose(cfg.connections);
        tracing::info!(connections = choice.n, basis = %choice.basis, "peer connections per peer");
        let cfg = &PeerConfig {
            connections: choice.n,
            ..cfg.clone()
        };
        Ok(Self {
            trust: Trust::new(cfg)?,
            wires: Wires::new(cfg, &store)?,
            cfg: cfg.clone(),
            conns_basis: choice.basis,
            membership: OnceLock::new(),
            hashes: hashes::HashCache::default(),
            ops: OpTable::default(),
            in_flight: join::KeysInFlight::default(),
            stats: PullStats::default(),
            counters: PeerCounters::default(),
            owners: AtomicU64::new(PULL_OWNER_BASE),
            store,
            metrics,
        })
    }

    /// The configuration in force (`connections` resolved: never 0).
    pub fn config(&self) -> &PeerConfig {
        &self.cfg
    }

    /// Why the connection count per peer is what it is (`stats`).
    pub fn connections_basis(&self) -> &str {
        &self.conns_basis
    }

    /// The node store pulls land in and pulls are served from.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The transport peers are dialled and served with.
    pub fn transport(&self) -> &transport::Transport {
        self.wires.transport()
    }

    /// This daemon's UCX state, when UCX is in use.
    pub fn ucx(&self) -> Option<&Arc<transport::UcxNode>> {
        self.wires.ucx()
    }

    /// Revokes the UCX key every peer holds to this daemon's arena (registers the arena
    /// afresh; open connections get the new key before their next answer). Run it when the
    /// cluster key rotates or a member is removed. `Ok(None)` without UCX.
    pub fn revoke_remote_access(&self) -> Result<Option<u64>, PeerError> {
        self.wires.revoke_remote_access()
    }

    /// The cluster keys in force now, if any.
    pub fn keys(&self) -> Option<Arc<KeyRing>> {
        self.trust.keys()
    }

    /// Whether a session derived from key `id` may go on (its key is still held).
    pub fn key_held(&self, id: Option<u64>) -> bool {
        self.trust.key_held(id)
    }

    /// Reads the cluster key file again (one or two keys) and uses it for every new
    /// handshake; sessions under a key no longer held are closed at their next request. On
    /// error the keys in force stay. A rotation also revokes the UCX key every peer was
    /// given to this arena. Returns a line for the log.
    pub fn reload_keys(&self) -> Result<String, PeerError> {
        let line = self.trust.reload()?;
        if let Some(g) = self.revoke_remote_access()? {
            return Ok(format!("{line}; UCX arena key re-issued (generation {g})"));
        }
        Ok(line)
    }

    /// Whether encryption is required of every session this daemon takes part in.
    pub fn encrypt(&self) -> bool {
        self.cfg.encrypt
    }

    /// This daemon's identity in handshakes.
    pub fn identity(&self) -> &Identity {
        self.trust.identity()
    }

    /// This daemon's advertised name.
    pub fn node(&self) -> &str {
        &self.trust.identity().node
    }

    /// Records where the peer listener is bound (for refusing hints that name this daemon).
    pub fn set_listening(&self, a: SocketAddr) {
        self.wires.set_listening(a);
    }

    /// Whether `a` is this daemon's own peer listener: its port, and an address of this
    /// host that the listener is bound to (any local address when it listens on a wildcard).
    pub fn is_self(&self, a: SocketAddr) -> bool {
        self.wires.is_self(a)
    }

    /// Connect plus authentication limit.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.connect_timeout_ms)
    }

    /// Heartbeat: longest silence while answers are owed.
    pub fn io_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.io_timeout_ms)
    }

    fn batch_keys(&self) -> usize {
        self.cfg.batch_keys as usize
    }

    /// A fresh tier reservation owner for one pulled block.
    fn reservation_owner(&self) -> u64 {
        self.owners.fetch_add(1, Ordering::Relaxed)
    }

    fn count_failure(&self) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
    }

    fn count_pulled(&self, bytes: u64) {
        self.counters.pulled_blocks.fetch_add(1, Ordering::Relaxed);
        self.counters
            .pulled_bytes
            .fetch_add(bytes, Ordering::Relaxed);
    }

    /// Installs the cluster membership view (once; a second call is refused and returns the
    /// view back).
    pub fn set_membership(&self, m: Arc<dyn Membership>) -> Result<(), Arc<dyn Membership>> {
        self.membership.set(m)
    }

    /// The cluster membership view, if the daemon runs with one.
    pub fn membership(&self) -> Option<&Arc<dyn Membership>> {
        self.membership.get()
    }

    /// Checks a hinted endpoint against the allowlist, then cluster membership (and
    /// loopback when keyless). Nothing is dialled before this says yes; membership answers
    /// from memory (never waits on etcd).
    pub fn authorize(&self, e: &Endpoint) -> Result<(), Failure> {
        let refuse = |m: String| Err(Failure::new(FailCode::NotAuthorized, m));
        if self.trust.names_me(e)
            || e.ip()
                .is_some_and(|ip| self.is_self(SocketAddr::new(ip, e.port)))
        {
            return refuse(format!("hint names this daemon ({e}) as the source"));
        }
        if self.trust.keys().is_none() && !config::is_loopback(e) {
            return refuse(format!(
                "{e} is not on loopback and this daemon has no cluster key"
            ));
        }
        if self.trust.allows(e) {
            return Ok(());
        }
        let refused_member = || {
            self.counters
                .refused_members
                .fetch_add(1, Ordering::Relaxed);
        };
        // Configured CIDRs bound the cluster's members too: a record in etcd naming an
        // address outside them (another service on the network) is never dialled.
        if self.membership.get().is_some() && self.trust.has_cidrs() {
            refused_member();
            return refuse(format!(
                "{e} is outside every CIDR in --peers: cluster members must lie within them"
            ));
        }
        match self.membership.get() {
            Some(m) => m.authorize(e).inspect_err(|_| refused_member()),
            None => refuse(format!("{e} is not an authorized peer (not in --peers)")),
        }
    }

    fn link(&self, e: &Endpoint) -> Arc<fetch::PeerLink> {
        self.wires.link(e, self.cfg.connections)
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        format!(
            "peer service {}; {}; {}",
            self.trust.identity().node,
            self.trust.describe(self.cfg.encrypt),
            self.wires.describe()
        )
    }
}
