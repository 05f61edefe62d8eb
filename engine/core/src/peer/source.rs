//! Source side: accepts authenticated peers and answers pulls from the local tiers.
//!
//! Each answered block is leased from the moment the pull is read until its last byte is
//! handed to the transport, so it cannot be evicted or reused while it is being sent. A key
//! that lives only on NVMe is promoted into DRAM first (the same path as a client `get`).
//! Each block goes out with its BLAKE3 hash in the sealed header, hashed once per block and
//! remembered ([`super::hashes`]); a block whose bytes changed since is answered `Miss`.
//!
//! On a connection that negotiated UCX (`UcxRequest`, sealed like every frame after the
//! handshake), blocks are answered with `Slot`s (where they lie in the registered arena,
//! and their hash) and stay leased until the destination says its GETs of the request are
//! done (`Landed`), the connection closes, or the destination stays silent for the io
//! timeout while leases are held. At most [`UCX_WINDOW`] requests are leased at once; later
//! `Pull`s wait in order. An encrypted session (`--peer-encrypt`) is never offered UCX:
//! GETs would move the bytes in the clear.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::NamespaceId;
use kvnode_proto::peer::{PeerMsg, PullKey};
use tokio::sync::watch;

use super::auth::accept_handshake;
use super::error::{PullError, Stage, Violation, WireError};
use super::hashes::Sums;
use super::transport::{PeerListener, TcpConn};
use super::{PeerError, Peers};
use crate::store::{Lease, Store};
use kvnode_blockmac::BlockMac;

pub(super) mod ahead;
pub(super) mod sums;

use ahead::SumsAhead;
use sums::{hash_threads, hashed, settled};

/// Idle pooled connections are closed after this long without a request.
const IDLE_LIMIT: Duration = Duration::from_mins(10);

/// Requests a UCX destination may hold leases for at once (each up to `batch_keys` blocks).
pub const UCX_WINDOW: usize = 4;

/// Where a source finds blocks: anything that can lease them (the node store; a test seam).
pub trait BlockSource: Send + Sync {
    /// Leases each key that is held (`None` for misses); dropping a lease ends it.
    fn lease(
        &self,
        ns: NamespaceId,
        keys: &[PullKey],
    ) -> impl Future<Output = Vec<Option<Lease>>> + Send;
}

impl BlockSource for Arc<Store> {
    async fn lease(&self, ns: NamespaceId, keys: &[PullKey]) -> Vec<Option<Lease>> {
        let keys: Vec<kvnode_proto::Key> =
            keys.iter().map(|k| kvnode_proto::Key(k.0, k.1)).collect();
        let Some(h) = self.handle_of(ns) else {
            return (0..keys.len()).map(|_| None).collect();
        };
        Store::lease(self, h, &keys)
            .await
            .unwrap_or_else(|_| (0..keys.len()).map(|_| None).collect())
    }
}

/// Answers one pull on a UCX connection: `Slot`s of leased blocks, kept in `held` under
/// `req` until the destination's `Landed`.
async fn serve_pull_ucx<S: BlockSource>(
    p: &Arc<Peers>,
    src: &S,
    w: &mut TcpConn,
    (dst, pull): (&str, (u64, NamespaceId, Vec<PullKey>)),
    limit: Duration,
    held: &mut HashMap<u64, Vec<Arc<Lease>>>,
) -> Result<(), PeerError> {
    let (req, ns, keys) = pull;
    // A keyed plaintext session's Slots carry the block MAC too (docs/peer-protocol.md).
    let mac = w.block_mac().cloned();
    let leased = shared(src.lease(ns, &keys).await);
    let mut ahead = SumsAhead::start(p, (ns, &keys), &leased, mac.as_ref(), hash_threads());
    let mut keep = Vec::with_capacity(leased.len());
    for (i, l) in leased.into_iter().enumerate() {
        let idx = i as u32;
        match summed(p, (ns, i, keys[i]), l, &mut ahead, mac.as_deref()).await {
            Some((b, sums)) => {
                let seal = mac
                    .as_ref()
                    .and_then(|m| sums.tag_for(m.id()))
                    .map(|t| t.to_vec())
                    .unwrap_or_default();
                let msg = PeerMsg::Slot {
                    req,
                    idx,
                    len: b.bytes().len() as u32,
                    addr: b.bytes().as_ptr() as u64,
                    hash: sums.hash.to_vec(),
                    seal,
                };
                keep.push(b);
                w.send(&msg, &[], limit).await?;
            }
            None => w.send(&PeerMsg::Miss { req, idx }, &[], limit).await?,
        }
    }
    p.count_slots_served(dst, keep.len() as u64);
    held.insert(req, keep);
    w.send(&PeerMsg::Done { req }, &[], limit).await
}

async fn serve_pull<S: BlockSource>(
    p: &Arc<Peers>,
    src: &S,
    w: &mut TcpConn,
    req: u64,
    ns: NamespaceId,
    keys: &[PullKey],
    limit: Duration,
) -> Result<(), PeerError> {
    // Each block stays leased until its last byte is handed to the transport; an early
    // return drops the rest.
    let mac = w.block_mac().cloned();
    let leased = shared(src.lease(ns, keys).await);
    let mut ahead = SumsAhead::start(p, (ns, keys), &leased, mac.as_ref(), hash_threads());
    let done = PeerMsg::Done { req };
    let last = leased.len().checked_sub(1);
    for (i, l) in leased.into_iter().enumerate() {
        let idx = i as u32;
        // The last answer carries the request's `Done` in the same writev.
        let then = (Some(i) == last).then_some(&done);
        match summed(p, (ns, i, keys[i]), l, &mut ahead, mac.as_deref()).await {
            Some((b, sums)) => {
                let bytes = b.bytes();
                // A keyed plaintext session carries the block's MAC in `seal` (inside the
                // sealed header); an encrypted one, the AEAD tag the transport puts there.
                let seal = mac
                    .as_ref()
                    .and_then(|m| sums.tag_for(m.id()))
                    .map(|t| t.to_vec())
                    .unwrap_or_default();
                let msg = PeerMsg::Block {
                    req,
                    idx,
                    len: bytes.len() as u32,
                    hash: sums.hash.to_vec(),
                    seal,
                };
                w.send_then(&msg, bytes, then, limit).await?;
            }
            None => {
                w.send_then(&PeerMsg::Miss { req, idx }, &[], then, limit)
                    .await?;
            }
        }
    }
    if last.is_none() {
        w.send(&done, &[], limit).await?;
    }
    Ok(())
}

/// Leases shared with the threads summing ahead ([`SumsAhead`]).
fn shared(leased: Vec<Option<Lease>>) -> Vec<Option<Arc<Lease>>> {
    leased.into_iter().map(|l| l.map(Arc::new)).collect()
}

/// Block `i`'s (key `k`'s) lease with its sums: from the threads summing ahead, or computed
/// here; `None` (answered `Miss`) when not leased or its bytes changed after they were first
/// hashed.
async fn summed(
    p: &Peers,
    (ns, i, k): (NamespaceId, usize, PullKey),
    l: Option<Arc<Lease>>,
    ahead: &mut SumsAhead,
    mac: Option<&BlockMac>,
) -> Option<(Arc<Lease>, Sums)> {
    let b = l?;
    match ahead.take(i).await {
        Some(h) => settled(p, b, h),
        None => hashed(p, ns, k, b, mac),
    }
}

async fn serve_conn(p: Arc<Peers>, mut w: TcpConn, mut stop: watch::Receiver<bool>) {
    let ring = p.keys();
    let shake = accept_handshake(
        &mut w,
        ring.as_deref(),
        p.identity(),
        p.encrypt(),
        p.connect_timeout(),
    )
    .await;
    let dst = match shake {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(peer = %w.remote(), error = %e, "peer refused");
            return;
        }
    };
    tracing::debug!(peer = %w.remote(), node = %dst, encrypted = w.encrypted(), "peer authenticated");
    let src = Arc::clone(p.store());
    let limit = p.io_timeout();
    // UCX state of this connection: the key generation it was given, the leases of
    // requests whose GETs are not confirmed, and pulls waiting for the window.
    let mut ucx: Option<u64> = None;
    let mut held: HashMap<u64, Vec<Arc<Lease>>> = HashMap::new();
    let mut queued: VecDeque<(u64, NamespaceId, Vec<PullKey>)> = VecDeque::new();
    loop {
        // Serve queued pulls while the window has room.
        while held.len() < UCX_WINDOW
            && let Some(pull) = queued.pop_front()
        {
            let r = serve_ucx(&p, &src, &mut w, (&dst, pull), limit, &mut ucx, &mut held).await;
            if let Err(e) = r {
                return closed(&mut w, e, limit).await;
            }
        }
        let wait = if held.is_empty() { IDLE_LIMIT } else { limit };
        let next = tokio::select! {
            r = w.recv(wait) => r,
            _ = stop.changed() => return,
        };
        if next.is_ok() && !p.key_held(w.key_id()) {
            tracing::info!(peer = %w.remote(), "closing a session whose cluster key was removed");
            return;
        }
        let r = match next {
            Ok((PeerMsg::Pull { req, ns, keys }, _)) if ucx.is_some() => {
                queued.push_back((req, ns, keys));
                Ok(())
            }
            Ok((PeerMsg::Pull { req, ns, keys }, _)) => {
                serve_pull(&p, &src, &mut w, req, ns, &keys, limit).await
            }
            Ok((PeerMsg::Landed { req }, _)) if ucx.is_some() => {
                if held.remove(&req).is_some() {
                    Ok(())
                } else {
                    Err(Violation::LandedUnheld { req }.into())
                }
            }
            Ok((PeerMsg::UcxRequest, _)) if ucx.is_none() => {
                offer_ucx(&p, &mut w, limit, &mut ucx).await
            }
            Err(e) if e.timed_out().is_some() && !held.is_empty() => {
                let blocks: usize = held.values().map(Vec::len).sum();
                tracing::warn!(peer = %w.remote(), blocks, "destination did not confirm its UCX GETs within the io timeout; closing and releasing its blocks");
                return;
            }
            Ok((PeerMsg::Ping { t }, _)) => w.send(&PeerMsg::Pong { t }, &[], limit).await,
            Ok((PeerMsg::Pong { .. }, _)) => Ok(()),
            Ok((other, _)) => {
                let e = PeerError::from(Violation::FromDestination {
                    got: Box::new(other),
                });
                let reason = e.to_string();
                let _ = w.send(&PeerMsg::Refused { reason }, &[], limit).await;
                Err(e)
            }
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            return closed(&mut w, e, limit).await;
        }
    }
}

/// Answers `UcxRequest` (on a session already authenticated and sealed): an offer, or a
/// decline without UCX or on an encrypted session.
async fn offer_ucx(
    p: &Peers,
    w: &mut TcpConn,
    limit: Duration,
    ucx: &mut Option<u64>,
) -> Result<(), PeerError> {
    let reason = match p.ucx() {
        None => "this daemon's peer transport is tcp".to_owned(),
        Some(_) if w.encrypted() => {
            "the session is encrypted (--peer-encrypt): UCX GETs would move blocks in the clear"
                .to_owned()
        }
        Some(u) => match u.offer() {
            Ok(None) => "this daemon exposes no memory over UCX".to_owned(),
            Ok(Some((offer, generation))) => {
                w.send(&offer, &[], limit).await?;
                *ucx = Some(generation);
                tracing::debug!(peer = %w.remote(), "peer reads blocks with UCX GETs");
                return Ok(());
            }
            Err(e) => format!("UCX key unavailable: {e}"),
        },
    };
    w.send(&PeerMsg::UcxDecline { reason }, &[], limit).await
}

/// Serves one queued pull on a UCX connection, handing over a re-issued key first if the
/// arena was re-registered since this connection got its key.
async fn serve_ucx<S: BlockSource>(
    p: &Arc<Peers>,
    src: &S,
    w: &mut TcpConn,
    (dst, pull): (&str, (u64, NamespaceId, Vec<PullKey>)),
    limit: Duration,
    ucx: &mut Option<u64>,
    held: &mut HashMap<u64, Vec<Arc<Lease>>>,
) -> Result<(), PeerError> {
    if let (Some(u), Some(given)) = (p.ucx(), ucx.as_mut())
        && u.generation() != *given
    {
        let (offer, generation) = u
            .offer()
            .map_err(PullError::UcxKey)?
            .ok_or(Violation::ExposureWithdrawn)?;
        w.send(&offer, &[], limit).await?;
        *given = generation;
    }
    serve_pull_ucx(p, src, w, (dst, pull), limit, held).await
}

/// Logs why a connection ends (telling the peer when it sent a bad frame).
async fn closed(w: &mut TcpConn, e: PeerError, limit: Duration) {
    match e {
        _ if e.timed_out() == Some(Stage::Send) => {
            tracing::warn!(peer = %w.remote(), error = %e, "destination stopped reading; closing and releasing its blocks");
        }
        PeerError::Wire(WireError::Io(_) | WireError::Timeout { .. }) => {
            tracing::debug!(peer = %w.remote(), error = %e, "peer connection closed");
        }
        _ if e.is_bad_frame() => {
            let _ = w
                .send(
                    &PeerMsg::Refused {
                        reason: e.to_string(),
                    },
                    &[],
                    limit,
                )
                .await;
            tracing::warn!(peer = %w.remote(), error = %e, "peer sent a bad frame; closing");
        }
        _ => tracing::warn!(peer = %w.remote(), error = %e, "peer connection dropped"),
    }
}

/// Accepts peer connections until `stop` turns true.
pub async fn serve(peers: Arc<Peers>, listener: PeerListener, mut stop: watch::Receiver<bool>) {
    if let Ok(a) = listener.local_addr() {
        peers.set_listening(a);
    }
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            a = listener.accept() => match a {
                Ok(w) => {
                    conns.spawn(serve_conn(Arc::clone(&peers), w, stop.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "peer accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            _ = stop.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.shutdown().await;
}
