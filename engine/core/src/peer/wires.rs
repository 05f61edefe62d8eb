//! How peers are reached: the transport (TCP, or UCX when it started), the per-peer links
//! (connection pools) and where this daemon's own listener is bound.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};

use kvnode_proto::hint::Endpoint;

use super::config::{PeerConfig, TransportKind};
use super::error::{ConfigError, PeerError};
use super::fetch::PeerLink;
use super::transport::{Transport, UcxNode, UcxSetup, UcxStartError};
use crate::store::Store;

/// The transport, the links to peers, and the listener's address.
#[derive(Debug)]
pub(super) struct Wires {
    transport: Transport,
    /// UCX, when the transport is `ucx` or `auto` and it initialized.
    ucx: Option<Arc<UcxNode>>,
    /// Why UCX is off under `auto` (for the start-up line).
    ucx_off: Option<String>,
    links: Mutex<HashMap<Endpoint, Arc<PeerLink>>>,
    /// Where the peer listener is bound (set when it starts serving).
    listening: OnceLock<SocketAddr>,
}

impl Wires {
    /// The transport `cfg` asks for: none of UCX for `tcp`; for `ucx` a start-up failure is
    /// the daemon's (a clear error, e.g. software RMA without the trusted-network switch);
    /// for `auto` it falls back to TCP, and the reason is kept for the start-up line.
    pub(super) fn new(cfg: &PeerConfig, store: &Arc<Store>) -> Result<Self, PeerError> {
        let (ucx, ucx_off) = if cfg.transport == TransportKind::Tcp {
            (None, None)
        } else {
            let setup = UcxSetup::resolve(&cfg.ucx_asked()).map_err(ConfigError::from)?;
            let started = UcxNode::start(store, &setup).map_err(|e| match e {
                UcxStartError::Ucx(e) => ConfigError::UcxStart(e),
                e => ConfigError::UcxUnsafe(e),
            });
            match (cfg.transport, started) {
                (_, Ok(n)) => (Some(Arc::new(n)), None),
                (TransportKind::Auto, Err(e)) => {
                    tracing::warn!(error = %e, "peer transport auto: UCX not used; pulling over TCP");
                    (None, Some(e.to_string()))
                }
                (_, Err(e)) => return Err(e.into()),
            }
        };
        Ok(Self {
            transport: Transport::from_config(cfg),
            ucx,
            ucx_off,
            links: Mutex::new(HashMap::new()),
            listening: OnceLock::new(),
        })
    }

    /// The transport peers are dialled and served with.
    pub(super) fn transport(&self) -> &Transport {
        &self.transport
    }

    /// This daemon's UCX state, when UCX is in use.
    pub(super) fn ucx(&self) -> Option<&Arc<UcxNode>> {
        self.ucx.as_ref()
    }

    /// Re-registers the arena with UCX (every key given out is revoked); `Ok(None)` without
    /// UCX.
    pub(super) fn revoke_remote_access(&self) -> Result<Option<u64>, PeerError> {
        let Some(u) = &self.ucx else { return Ok(None) };
        let g = u.reregister().map_err(ConfigError::Reregister)?;
        tracing::info!(generation = g, "UCX arena key revoked and re-issued");
        Ok(Some(g))
    }

    /// Records where the peer listener is bound.
    pub(super) fn set_listening(&self, a: SocketAddr) {
        let _ = self.listening.set(a);
    }

    /// Whether `a` is this daemon's own peer listener: its port, and an address of this
    /// host that the listener is bound to (any local address when it listens on a wildcard).
    pub(super) fn is_self(&self, a: SocketAddr) -> bool {
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

    /// The link to `e` (made on first use with `connections` connections).
    pub(super) fn link(&self, e: &Endpoint, connections: u32) -> Arc<PeerLink> {
        let mut m = self.links.lock().expect("links lock");
        Arc::clone(
            m.entry(e.clone())
                .or_insert_with(|| Arc::new(PeerLink::new(e.clone(), connections))),
        )
    }

    /// Every link made so far.
    pub(super) fn links(&self) -> Vec<Arc<PeerLink>> {
        self.links
            .lock()
            .expect("links lock")
            .values()
            .cloned()
            .collect()
    }

    /// The transport part of the start-up line.
    pub(super) fn describe(&self) -> String {
        match (&self.ucx, &self.ucx_off) {
            (Some(u), _) => format!("transport ucx ({})", u.describe()),
            (None, Some(why)) => format!("transport tcp (auto: UCX unavailable: {why})"),
            (None, None) => "transport tcp".to_owned(),
        }
    }
}

/// Whether `ip` is an address of this host (something may bind to it).
fn is_local_address(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}
