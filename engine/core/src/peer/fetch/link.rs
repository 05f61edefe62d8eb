//! One peer this daemon pulls from: its idle connections, connection permits, request ids
//! and UCX state, and dialling it (connect, handshake, UCX negotiation).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerMsg;
use tokio::sync::Semaphore;

use crate::peer::auth::dial_handshake;
use crate::peer::error::{Expected, HandshakeError, PullError, Stage, Verbatim};
use crate::peer::transport::{PullWire, TcpConn, UcxNode, UcxPeer};
use crate::peer::{PeerError, Peers};

/// Everything this daemon keeps about one peer it pulls from.
#[derive(Debug)]
pub struct PeerLink {
    /// Endpoint.
    pub endpoint: Endpoint,
    /// `tcp://host:port`.
    pub name: String,
    /// Authenticated connections not in use.
    pub(super) idle: Mutex<Vec<PullWire>>,
    /// One per connection this daemon may hold to the peer.
    pub(super) permits: Arc<Semaphore>,
    /// Set when a UCX endpoint to this peer could not be opened: later dials use TCP only.
    ucx_broken: AtomicBool,
    /// Keys requested and not yet answered or failed.
    pub outstanding: AtomicU64,
    /// The next `Pull` request id.
    pub(super) next_req: AtomicU64,
    /// Blocks read from this peer with UCX GETs (`stats.peer`).
    pub ucx_gets: AtomicU64,
    /// Connections to this peer wanted on UCX that went over TCP (`stats.peer`).
    pub ucx_fallbacks: AtomicU64,
}

impl Peers {
    /// Connects to `e` and runs the handshake, both within the connect timeout: an
    /// authenticated, sealed connection.
    pub(crate) async fn dial_authenticated(&self, e: &Endpoint) -> Result<TcpConn, PeerError> {
        let limit = self.connect_timeout();
        let t = Instant::now();
        let connect = self.transport().dial(e, |a| self.is_self(a));
        let mut w = tokio::time::timeout(limit, connect)
            .await
            .map_err(|_| PeerError::timeout(Stage::Connect, limit))??;
        let left = limit.saturating_sub(t.elapsed());
        let ring = self.keys();
        let shake = dial_handshake(
            &mut w,
            ring.as_deref(),
            self.node(),
            e,
            self.encrypt(),
            left,
        );
        tokio::time::timeout(left, shake)
            .await
            .map_err(|_| PeerError::timeout(Stage::Handshake, limit))??;
        Ok(w)
    }
}

impl PeerLink {
    /// A link with no connection yet.
    pub fn new(endpoint: Endpoint, connections: u32) -> Self {
        Self {
            name: endpoint.to_string(),
            endpoint,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(connections as usize)),
            ucx_broken: AtomicBool::new(false),
            outstanding: AtomicU64::new(0),
            next_req: AtomicU64::new(1),
            ucx_gets: AtomicU64::new(0),
            ucx_fallbacks: AtomicU64::new(0),
        }
    }

    pub(super) async fn dial(&self, p: &Peers) -> Result<PullWire, PeerError> {
        match self.dial_once(p).await {
            Err(PeerError::Pull(PullError::UcxConnect(why))) => {
                // The source offered UCX but no endpoint to it could be opened (no common
                // UCX transport): remember, and pull from it over TCP from now on.
                tracing::warn!(peer = %self.name, error = %why, "cannot open a UCX endpoint to this peer; using TCP for it");
                self.ucx_broken.store(true, Ordering::Relaxed);
                self.dial_once(p).await
            }
            r => r,
        }
    }

    async fn dial_once(&self, p: &Peers) -> Result<PullWire, PeerError> {
        let limit = p.connect_timeout();
        let t = Instant::now();
        let mut w = p.dial_authenticated(&self.endpoint).await?;
        // Encrypted sessions never use UCX (GETs would move the bytes in the clear): not a
        // fallback. A peer that declines, or whose endpoint could not be opened, is one.
        let ucx = match p.ucx() {
            Some(u) if p.transport().plain() && !p.encrypt() => {
                let got = if self.ucx_broken.load(Ordering::Relaxed) {
                    None
                } else {
                    let left = limit.saturating_sub(t.elapsed());
                    self.negotiate_ucx(&mut w, u, left).await?
                };
                if got.is_none() {
                    self.ucx_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                got
            }
            _ => None,
        };
        p.stats.record_connect(&self.name, t.elapsed());
        Ok(p.transport().pull_end(w, ucx)?)
    }

    /// Asks the (authenticated) source for UCX access; `None` when it declines.
    async fn negotiate_ucx(
        &self,
        w: &mut TcpConn,
        u: &Arc<UcxNode>,
        limit: Duration,
    ) -> Result<Option<(UcxPeer, Arc<UcxNode>)>, PeerError> {
        w.send(&PeerMsg::UcxRequest, &[], limit).await?;
        match w.recv(limit).await?.0 {
            PeerMsg::UcxOffer {
                worker,
                rkey,
                base,
                len,
            } => {
                let peer = u
                    .connect(&worker, &rkey, base, len)
                    .map_err(PullError::UcxConnect)?;
                tracing::info!(peer = %self.name, "pulling from this peer with UCX GETs");
                Ok(Some((peer, Arc::clone(u))))
            }
            PeerMsg::UcxDecline { reason } => {
                tracing::info!(peer = %self.name, reason, "peer declined UCX; pulling over TCP");
                Ok(None)
            }
            PeerMsg::Refused { reason } => Err(HandshakeError::Refused(Verbatim(reason)).into()),
            other => Err(HandshakeError::Unexpected {
                expected: Expected::UcxOfferOrDecline,
                got: Box::new(other),
            }
            .into()),
        }
    }

    pub(super) fn checkin(&self, w: PullWire) {
        self.idle.lock().expect("idle lock").push(w);
    }
}

/// Whether an error on a pooled connection, before any answer, means it went stale (the
/// peer restarted): then one retry on a fresh connection is safe.
pub(super) fn stale(e: &PeerError) -> bool {
    e.is_broken_connection()
}
