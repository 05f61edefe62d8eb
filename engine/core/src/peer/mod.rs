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
pub mod membership;
pub mod op;
mod report;
pub mod source;
mod start;
pub use start::PullRequest;
pub mod timeouts;
pub mod transport;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ucx;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::pull::{FailCode, Failure};

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
}

/// The peer service of one daemon: authorization, links, operations, measurements.
#[derive(Debug)]
pub struct Peers {
    cfg: PeerConfig,
    /// Why `cfg.connections` is what it is (`configured`, or the automatic choice's basis).
    conns_basis: String,
    allow: Vec<Allowed>,
    /// The cluster keys (`None`: keyless, fixed at start; the keys can be reloaded).
    keys: Option<RwLock<Arc<KeyRing>>>,
    identity: Identity,
    me: Option<Endpoint>,
    /// Where the peer listener is bound (set when it starts serving).
    listening: OnceLock<SocketAddr>,
    /// Content hashes of blocks sent and pulled.
    pub hashes: hashes::HashCache,
    links: Mutex<HashMap<Endpoint, Arc<fetch::PeerLink>>>,
    /// Cluster membership, when the daemon runs with one (set once at start-up).
    membership: OnceLock<Arc<dyn Membership>>,
    /// Operations.
    pub ops: OpTable,
    /// Latency measurements.
    pub stats: PullStats,
    /// Counters.
    pub counters: PeerCounters,
    owners: AtomicU64,
    transport: transport::Transport,
    /// UCX, when `transport` is `ucx` or `auto` and it initialized.
    ucx: Option<Arc<transport::UcxNode>>,
    /// Why UCX is off under `auto` (for the start-up line).
    ucx_off: Option<String>,
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
        let allow = cfg.allowlist()?;
        let keys = cfg
            .cluster_key
            .as_deref()
            .map(KeyRing::load)
            .transpose()?
            .map(|r| RwLock::new(Arc::new(r)));
        let me = cfg
            .advertise
            .as_deref()
            .or_else(|| {
                cfg.listen
                    .as_deref()
                    .filter(|l| !l.starts_with("0.0.0.0") && !l.starts_with("[::]"))
            })
            .and_then(|a| {
                Endpoint::parse(a)
                    .or_else(|_| Endpoint::parse(&format!("tcp://{a}")))
                    .ok()
            });
        let (ucx, ucx_off) = Self::start_ucx(cfg, &store)?;
        Ok(Self {
            ucx,
            ucx_off,
            identity: Identity {
                node: me
                    .as_ref()
                    .map_or_else(|| "unnamed".to_owned(), ToString::to_string),
                advertised: me.clone(),
            },
            cfg: cfg.clone(),
            conns_basis: choice.basis,
            allow,
            keys,
            me,
            listening: OnceLock::new(),
            hashes: hashes::HashCache::default(),
            links: Mutex::new(HashMap::new()),
            membership: OnceLock::new(),
            ops: OpTable::default(),
            stats: PullStats::default(),
            counters: PeerCounters::default(),
            owners: AtomicU64::new(PULL_OWNER_BASE),
            transport: transport::Transport::from_config(cfg),
            store,
            metrics,
        })
    }

    /// UCX as `cfg.transport` asks: none for `tcp`; for `ucx` a start-up failure is the
    /// daemon's (a clear error, e.g. software RMA without the trusted-network switch); for
    /// `auto` it falls back to TCP, and the reason is kept for the start-up line.
    fn start_ucx(
        cfg: &PeerConfig,
        store: &Arc<Store>,
    ) -> Result<(Option<Arc<transport::UcxNode>>, Option<String>), PeerError> {
        if cfg.transport == TransportKind::Tcp {
            return Ok((None, None));
        }
        let setup = transport::UcxSetup::resolve(&cfg.ucx_asked()).map_err(ConfigError::from)?;
        let started = transport::UcxNode::start(store, &setup).map_err(|e| match e {
            transport::UcxStartError::Ucx(e) => ConfigError::UcxStart(e),
            e => ConfigError::UcxUnsafe(e),
        });
        match (cfg.transport, started) {
            (_, Ok(n)) => Ok((Some(Arc::new(n)), None)),
            (TransportKind::Auto, Err(e)) => {
                tracing::warn!(error = %e, "peer transport auto: UCX not used; pulling over TCP");
                Ok((None, Some(e.to_string())))
            }
            (_, Err(e)) => Err(e.into()),
        }
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
        &self.transport
    }

    /// This daemon's UCX state, when UCX is in use.
    pub fn ucx(&self) -> Option<&Arc<transport::UcxNode>> {
        self.ucx.as_ref()
    }

    /// Revokes the UCX key every peer holds to this daemon's arena (registers the arena
    /// afresh; open connections get the new key before their next answer). Run it when the
    /// cluster key rotates or a member is removed. `Ok(None)` without UCX.
    pub fn revoke_remote_access(&self) -> Result<Option<u64>, PeerError> {
        let Some(u) = &self.ucx else { return Ok(None) };
        let g = u.reregister().map_err(ConfigError::Reregister)?;
        tracing::info!(generation = g, "UCX arena key revoked and re-issued");
        Ok(Some(g))
    }

    /// The cluster keys in force now, if any.
    pub fn keys(&self) -> Option<Arc<KeyRing>> {
        self.keys
            .as_ref()
            .map(|k| Arc::clone(&k.read().expect("key lock")))
    }

    /// Whether a session derived from key `id` may go on (its key is still held).
    pub fn key_held(&self, id: Option<u64>) -> bool {
        match (self.keys(), id) {
            (Some(r), Some(id)) => r.get(id).is_some(),
            (None, None) => true,
            _ => false,
        }
    }

    /// Reads the cluster key file again (one or two keys) and uses it for every new
    /// handshake; sessions under a key no longer held are closed at their next request. On
    /// error the keys in force stay. Returns a line for the log.
    pub fn reload_keys(&self) -> Result<String, PeerError> {
        let (Some(path), Some(lock)) = (self.cfg.cluster_key.as_deref(), self.keys.as_ref()) else {
            return Err(ConfigError::NoKeyFile.into());
        };
        let ring = KeyRing::load(path)?;
        let line = format!(
            "cluster keys reloaded from {}: ids {} (were {})",
            path.display(),
            ring.describe(),
            lock.read().expect("key lock").describe()
        );
        *lock.write().expect("key lock") = Arc::new(ring);
        // A key rotation also revokes the UCX key every peer was given to this arena.
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
        &self.identity
    }

    /// This daemon's advertised name.
    pub fn node(&self) -> &str {
        &self.identity.node
    }

    /// Records where the peer listener is bound (for refusing hints that name this daemon).
    pub fn set_listening(&self, a: SocketAddr) {
        let _ = self.listening.set(a);
    }

    /// Whether `a` is this daemon's own peer listener: its port, and an address of this
    /// host that the listener is bound to (any local address when it listens on a wildcard).
    pub fn is_self(&self, a: SocketAddr) -> bool {
        let Some(l) = self.listening.get() else {
            return false;
        };
        if a.port() != l.port() {
            return false;
        }
        let ip = a.ip().to_canonical();
        if ip == l.ip().to_canonical() {
            return true;
        }
        l.ip().is_unspecified() && (ip.is_loopback() || is_local_address(ip))
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
        if self.me.as_ref() == Some(e)
            || e.ip()
                .is_some_and(|ip| self.is_self(SocketAddr::new(ip, e.port)))
        {
            return refuse(format!("hint names this daemon ({e}) as the source"));
        }
        if self.keys.is_none() && !config::is_loopback(e) {
            return refuse(format!(
                "{e} is not on loopback and this daemon has no cluster key"
            ));
        }
        if self.allow.iter().any(|a| a.admits(e)) {
            return Ok(());
        }
        // Configured CIDRs bound the cluster's members too: a record in etcd naming an
        // address outside them (another service on the network) is never dialled.
        if self.membership.get().is_some()
            && self
                .allow
                .iter()
                .any(|a| matches!(a, config::Allowed::Cidr(..)))
        {
            self.counters
                .refused_members
                .fetch_add(1, Ordering::Relaxed);
            return refuse(format!(
                "{e} is outside every CIDR in --peers: cluster members must lie within them"
            ));
        }
        match self.membership.get() {
            Some(m) => m.authorize(e).inspect_err(|_| {
                self.counters
                    .refused_members
                    .fetch_add(1, Ordering::Relaxed);
            }),
            None => refuse(format!("{e} is not an authorized peer (not in --peers)")),
        }
    }

    fn link(&self, e: &Endpoint) -> Arc<fetch::PeerLink> {
        let mut m = self.links.lock().expect("links lock");
        Arc::clone(
            m.entry(e.clone())
                .or_insert_with(|| Arc::new(fetch::PeerLink::new(e.clone(), self.cfg.connections))),
        )
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        let sealing = if self.cfg.encrypt {
            "every frame encrypted (AES-256-GCM)"
        } else {
            "every header encrypted (AES-256-GCM), block bodies in the clear and authenticated by their BLAKE3 hash"
        };
        let auth = match self.keys() {
            Some(r) => format!(
                "cluster key ids {}: peers prove the key in a handshake bound to both daemons; {sealing}",
                r.describe()
            ),
            None => "no cluster key: only loopback peers are served and dialled; frames carry integrity tags, which authenticate nothing without a key".to_owned(),
        };
        let transport = match (&self.ucx, &self.ucx_off) {
            (Some(u), _) => format!("transport ucx ({})", u.describe()),
            (None, Some(why)) => format!("transport tcp (auto: UCX unavailable: {why})"),
            (None, None) => "transport tcp".to_owned(),
        };
        format!(
            "peer service {}; {auth}; {transport}; {} allowlist entries",
            self.identity.node,
            self.allow.len()
        )
    }
}

/// Whether `ip` is an address of this host (something may bind to it).
fn is_local_address(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}
