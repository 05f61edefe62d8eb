//! Peer pulls: router-hinted transfers of blocks between daemons (docs/peer-protocol.md).
//!
//! ```text
//!  client Get/Exists/Pull + hint ─> start (parse, match hashes, authorize: no dial before)
//!        └─> PullOp (per-key outcomes, deadline, fence) ─> fetch::run_chunk per connection
//!              └─> PullWire (blocking thread; TCP) ──Pull──> source::serve on the peer ──Block/Miss/Done──┘
//! ```
//!
//! - [`config`]: `[peer]` settings and the allowlist.
//! - [`auth`]: cluster key and the HMAC challenge-response handshake.
//! - [`transport`]: the transport seam (TCP, fault-injecting) and framed, time-bounded I/O.
//! - [`source`]: answering pulls from the local tier.
//! - [`fetch`]: per-peer connection pools and pulling into reserved DRAM slots.
//! - [`op`]: operations, their outcomes and the buffer fence.
//! - [`timeouts`]: latency histograms and the declared timeout model.

pub mod auth;
pub mod config;
pub mod fetch;
pub mod op;
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerFrameError;
use kvnode_proto::pull::{FailCode, Failure};

pub use auth::ClusterKey;
pub use config::{Allowed, PeerConfig, TransportKind};
pub use op::{OpTable, PullOp};
pub use timeouts::PullStats;

use crate::obs::Metrics;
use crate::store::Store;

/// Reserved owner ids of peer pulls live above this (client connections count from 1).
const PULL_OWNER_BASE: u64 = 1 << 62;

/// A peer transfer or configuration failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// Socket I/O.
    #[error("peer I/O failed: {0}")]
    Io(#[from] std::io::Error),
    /// No progress within a limit.
    #[error("{0} timed out after {1:?} (peer dead or frozen?)")]
    Timeout(&'static str, Duration),
    /// The peer closed inside a block.
    #[error("peer closed mid-block after {0} of {1} bytes: block not committed")]
    Truncated(usize, usize),
    /// Undecodable frame.
    #[error("peer sent a malformed frame: {0}")]
    Frame(#[from] PeerFrameError),
    /// Well-formed frames out of protocol order.
    #[error("peer protocol violation: {0}")]
    Protocol(String),
    /// The peer refused us.
    #[error("peer refused the connection: {0}")]
    Refused(String),
    /// Authentication failed.
    #[error("peer authentication failed: {0}")]
    Auth(String),
    /// Cluster key unusable.
    #[error("cluster key: {0}")]
    Key(String),
    /// A GET neither completed nor was given back by UCX: its destination memory is retired.
    #[error("peer GET could not be cancelled: {0} (its slot is retired, never reused)")]
    Stuck(String),
    /// The source offered UCX and no endpoint to it could be opened.
    #[error("cannot open a UCX endpoint to the peer: {0}")]
    UcxConnect(String),
    /// Every connection to the peer is busy (it may be frozen).
    #[error("peer {0} is busy: every connection is held by pulls in flight (frozen peer?)")]
    Busy(String),
    /// Bad `[peer]` configuration.
    #[error("invalid peer configuration: {0}")]
    Config(String),
}

impl PeerError {
    /// The failure code a client sees for keys this error failed.
    pub fn code(&self) -> FailCode {
        match self {
            PeerError::Io(_)
            | PeerError::Timeout(..)
            | PeerError::Truncated(..)
            | PeerError::Stuck(_)
            | PeerError::UcxConnect(_) => FailCode::PeerUnreachable,
            PeerError::Busy(_) => FailCode::PeerBusy,
            PeerError::Refused(_) | PeerError::Auth(_) | PeerError::Key(_) => FailCode::PeerRefused,
            PeerError::Frame(_) | PeerError::Protocol(_) | PeerError::Config(_) => {
                FailCode::PeerFailed
            }
        }
    }

    /// This error as a client-visible failure.
    pub fn failure(&self) -> Failure {
        Failure::new(self.code(), self.to_string())
    }
}

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
    /// Blocks this source answered with a UCX `Slot` (read by the destination's GET).
    pub ucx_slots_served: AtomicU64,
}

/// The peer service of one daemon: authorization, links, operations, measurements.
#[derive(Debug)]
pub struct Peers {
    cfg: PeerConfig,
    allow: Vec<Allowed>,
    key: Option<ClusterKey>,
    node: String,
    me: Option<Endpoint>,
    links: Mutex<HashMap<Endpoint, Arc<fetch::PeerLink>>>,
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
        cfg.validate().map_err(PeerError::Config)?;
        let allow = cfg.allowlist().map_err(PeerError::Config)?;
        let key = cfg
            .cluster_key
            .as_deref()
            .map(ClusterKey::load)
            .transpose()?;
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
        let (ucx, ucx_off) = match cfg.transport {
            TransportKind::Tcp => (None, None),
            TransportKind::Ucx => {
                let n = transport::UcxNode::start(&store).map_err(|e| {
                    PeerError::Config(format!(
                        "peer transport ucx: {e} (is libucx0 installed and UCX_TLS valid? `ucx_info -d` lists the transports)"
                    ))
                })?;
                (Some(Arc::new(n)), None)
            }
            TransportKind::Auto => match transport::UcxNode::start(&store) {
                Ok(n) => (Some(Arc::new(n)), None),
                Err(e) => {
                    tracing::warn!(error = %e, "peer transport auto: UCX did not initialize; pulling over TCP");
                    (None, Some(e.to_string()))
                }
            },
        };
        Ok(Self {
            ucx,
            ucx_off,
            node: me
                .as_ref()
                .map_or_else(|| "unnamed".to_owned(), ToString::to_string),
            cfg: cfg.clone(),
            allow,
            key,
            me,
            links: Mutex::new(HashMap::new()),
            ops: OpTable::default(),
            stats: PullStats::default(),
            counters: PeerCounters::default(),
            owners: AtomicU64::new(PULL_OWNER_BASE),
            transport: transport::Transport::from_config(cfg),
            store,
            metrics,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &PeerConfig {
        &self.cfg
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
        let g = u
            .reregister()
            .map_err(|e| PeerError::Config(format!("re-registering the arena with UCX: {e}")))?;
        tracing::info!(generation = g, "UCX arena key revoked and re-issued");
        Ok(Some(g))
    }

    /// The cluster key, if any.
    pub fn key(&self) -> Option<&ClusterKey> {
        self.key.as_ref()
    }

    /// This daemon's advertised name.
    pub fn node(&self) -> &str {
        &self.node
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

    /// Checks a hinted endpoint against the allowlist (and loopback when keyless). Nothing
    /// is dialled before this says yes.
    pub fn authorize(&self, e: &Endpoint) -> Result<(), Failure> {
        let refuse = |m: String| Err(Failure::new(FailCode::NotAuthorized, m));
        if self.me.as_ref() == Some(e) {
            return refuse(format!("hint names this daemon ({e}) as the source"));
        }
        if self.key.is_none() && !config::is_loopback(e) {
            return refuse(format!(
                "{e} is not on loopback and this daemon has no cluster key"
            ));
        }
        if self.allow.iter().any(|a| a.admits(e)) {
            Ok(())
        } else {
            refuse(format!("{e} is not an authorized peer (not in --peers)"))
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
        let auth = if self.key.is_some() {
            "cluster key loaded: peers authenticate with HMAC-SHA256 challenge-response".to_owned()
        } else {
            "no cluster key: only loopback peers are served and dialled".to_owned()
        };
        let transport = match (&self.ucx, &self.ucx_off) {
            (Some(u), _) => format!("transport ucx ({})", u.describe()),
            (None, Some(why)) => format!("transport tcp (auto: UCX unavailable: {why})"),
            (None, None) => "transport tcp".to_owned(),
        };
        format!(
            "peer service {}; {auth}; {transport}; {} allowlist entries",
            self.node,
            self.allow.len()
        )
    }
}
