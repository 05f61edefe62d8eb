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

use kvnode_proto::peer::{PeerMeta, PeerMsg, PullKey};
use kvnode_proto::{Digest, NamespaceId};
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

    /// The page digest announced under each router hash in namespace `ns`, or `None`.
    fn resolve(&self, ns: NamespaceId, hashes: &[u64]) -> Vec<Option<Digest>>;

    /// The router metadata this node announced key `key` of namespace `ns` with, if it did
    /// (what a destination that asked announces the pulled block with).
    fn meta(&self, ns: NamespaceId, key: &PullKey) -> Option<PeerMeta>;
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

    fn resolve(&self, ns: NamespaceId, hashes: &[u64]) -> Vec<Option<Digest>> {
        self.announcer().resolve(ns, hashes)
    }

    fn meta(&self, ns: NamespaceId, key: &PullKey) -> Option<PeerMeta> {
        let m = self.announcer().meta_of(ns, &key.0)?;
        Some(PeerMeta {
            tokens: m.tokens.clone(),
            parent: m.parent,
        })
    }
}

/// One `Pull` as received.
#[derive(Debug)]
struct Pull {
    req: u64,
    ns: NamespaceId,
    keys: Vec<PullKey>,
    /// The destination asked for each block's router metadata.
    meta: bool,
}

/// What answering a connection's pulls needs besides the connection itself.
struct Serving<'a, S> {
    peers: &'a Arc<Peers>,
    src: &'a S,
    /// The destination, by its handshake name (`stats.peer`).
    dst: &'a str,
    /// Longest wait on the connection.
    limit: Duration,
}

/// How a connection hands block bytes over (the source's half of the transport contract).
enum Delivery<'a> {
    /// On the connection, after each `Block` header (TCP). The request's `Done` goes out in
    /// the write of its last answer.
    Inline,
    /// Left in the registered arena and named by a `Slot` for the destination's GET (UCX).
    /// The request's leases go to `held` until the destination's `Landed`.
    Slots(&'a mut HashMap<u64, Vec<Arc<Lease>>>),
}

/// Answers one pull, in key order: each leased block as `delivery` hands blocks over, each
/// other key `Miss`, then `Done`. A block stays leased until its last byte is handed to the
/// transport (inline) or its GET is confirmed (slots); an early return drops the rest.
async fn serve_pull<S: BlockSource>(
    cx: &Serving<'_, S>,
    w: &mut TcpConn,
    pull: Pull,
    mut delivery: Delivery<'_>,
) -> Result<(), PeerError> {
    let Pull {
        req,
        ns,
        keys,
        meta,
    } = pull;
    // A keyed plaintext session carries the block's MAC in `seal` (inside the sealed header),
    // for a `Block` and a `Slot` alike; an encrypted one, the AEAD tag the transport puts there.
    let mac = w.block_mac().cloned();
    let batch = Batch {
        peers: cx.peers,
        ns,
        keys: &keys,
        mac: mac.as_ref(),
    };
    let leased = shared(cx.src.lease(ns, &keys).await);
    let mut ahead = SumsAhead::start(&batch, &leased, hash_threads());
    let done = PeerMsg::Done { req };
    let last = leased.len().checked_sub(1);
    let mut keep = Vec::new();
    for (i, l) in leased.into_iter().enumerate() {
        let idx = i as u32;
        let inline = matches!(delivery, Delivery::Inline);
        // Inline, the last answer carries the request's `Done` in the same writev.
        let then = (inline && Some(i) == last).then_some(&done);
        let Some((b, sums)) = summed(&batch, i, l, &mut ahead).await else {
            w.send_then(&PeerMsg::Miss { req, idx }, &[], then, cx.limit)
                .await?;
            continue;
        };
        let (len, hash, seal) = (
            b.bytes().len() as u32,
            sums.hash.to_vec(),
            batch.seal(&sums),
        );
        let meta = meta.then(|| cx.src.meta(ns, &keys[i])).flatten();
        if inline {
            let msg = PeerMsg::Block {
                req,
                idx,
                len,
                hash,
                seal,
                meta,
            };
            w.send_then(&msg, b.bytes(), then, cx.limit).await?;
        } else {
            let addr = b.bytes().as_ptr() as u64;
            keep.push(b);
            let msg = PeerMsg::Slot {
                req,
                idx,
                len,
                addr,
                hash,
                seal,
                meta,
            };
            w.send(&msg, &[], cx.limit).await?;
        }
    }
    if let Delivery::Slots(held) = &mut delivery {
        cx.peers.count_slots_served(cx.dst, keep.len() as u64);
        held.insert(req, keep);
    } else if last.is_some() {
        return Ok(());
    }
    w.send(&done, &[], cx.limit).await
}

/// One pull's keys and what summing their blocks needs.
#[derive(Clone, Copy)]
pub(super) struct Batch<'a> {
    pub(super) peers: &'a Arc<Peers>,
    pub(super) ns: NamespaceId,
    pub(super) keys: &'a [PullKey],
    /// The session's block MAC (keyed plaintext sessions).
    pub(super) mac: Option<&'a Arc<BlockMac>>,
}

impl Batch<'_> {
    /// The `seal` of a block with `sums`: its tag under the session's block MAC, or empty.
    fn seal(&self, sums: &Sums) -> Vec<u8> {
        self.mac
            .and_then(|m| sums.tag_for(m.id()))
            .map(|t| t.to_vec())
            .unwrap_or_default()
    }
}

/// Leases shared with the threads summing ahead ([`SumsAhead`]).
fn shared(leased: Vec<Option<Lease>>) -> Vec<Option<Arc<Lease>>> {
    leased.into_iter().map(|l| l.map(Arc::new)).collect()
}

/// Block `i`'s lease with its sums: from the threads summing ahead, or computed here;
/// `None` (answered `Miss`) when not leased or its bytes changed after they were first
/// hashed.
async fn summed(
    batch: &Batch<'_>,
    i: usize,
    l: Option<Arc<Lease>>,
    ahead: &mut SumsAhead,
) -> Option<(Arc<Lease>, Sums)> {
    let b = l?;
    match ahead.take(i).await {
        Some(h) => settled(batch.peers, b, h),
        None => hashed(
            batch.peers,
            batch.ns,
            batch.keys[i],
            b,
            batch.mac.map(|m| &**m),
        ),
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
    let cx = Serving {
        peers: &p,
        src: &src,
        dst: &dst,
        limit: p.io_timeout(),
    };
    let mut ucx = UcxState::default();
    loop {
        // Serve queued pulls while the window has room.
        while ucx.held.len() < UCX_WINDOW
            && let Some(pull) = ucx.queued.pop_front()
        {
            let r = serve_ucx(&cx, &mut w, pull, &mut ucx).await;
            if let Err(e) = r {
                return closed(&mut w, e, cx.limit).await;
            }
        }
        let wait = if ucx.held.is_empty() {
            IDLE_LIMIT
        } else {
            cx.limit
        };
        let next = tokio::select! {
            r = w.recv(wait) => r,
            _ = stop.changed() => return,
        };
        if next.is_ok() && !p.key_held(w.key_id()) {
            tracing::info!(peer = %w.remote(), "closing a session whose cluster key was removed");
            return;
        }
        if let Err(e) = next.as_ref()
            && e.timed_out().is_some()
            && !ucx.held.is_empty()
        {
            let blocks: usize = ucx.held.values().map(Vec::len).sum();
            tracing::warn!(peer = %w.remote(), blocks, "destination did not confirm its UCX GETs within the io timeout; closing and releasing its blocks");
            return;
        }
        let r = match next {
            Ok((msg, _)) => answer(&cx, &mut w, msg, &mut ucx).await,
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            return closed(&mut w, e, cx.limit).await;
        }
    }
}

/// A connection's UCX state: the key generation it was given (`None`: no UCX on it), the
/// leases of requests whose GETs are not confirmed, and pulls waiting for the window.
#[derive(Default)]
struct UcxState {
    given: Option<u64>,
    held: HashMap<u64, Vec<Arc<Lease>>>,
    queued: VecDeque<Pull>,
}

/// Acts on one message from the destination.
async fn answer<S: BlockSource>(
    cx: &Serving<'_, S>,
    w: &mut TcpConn,
    msg: PeerMsg,
    ucx: &mut UcxState,
) -> Result<(), PeerError> {
    match msg {
        PeerMsg::Pull {
            req,
            ns,
            keys,
            meta,
        } if ucx.given.is_some() => {
            ucx.queued.push_back(Pull {
                req,
                ns,
                keys,
                meta,
            });
            Ok(())
        }
        PeerMsg::Pull {
            req,
            ns,
            keys,
            meta,
        } => {
            let pull = Pull {
                req,
                ns,
                keys,
                meta,
            };
            serve_pull(cx, w, pull, Delivery::Inline).await
        }
        PeerMsg::Landed { req } if ucx.given.is_some() => match ucx.held.remove(&req) {
            Some(_) => Ok(()),
            None => Err(Violation::LandedUnheld { req }.into()),
        },
        PeerMsg::UcxRequest if ucx.given.is_none() => {
            offer_ucx(cx.peers, w, cx.limit, &mut ucx.given).await
        }
        PeerMsg::Resolve { req, ns, hashes } => {
            let digests = cx.src.resolve(ns, &hashes);
            cx.peers.counters.resolved(&digests);
            w.send(&PeerMsg::Resolved { req, digests }, &[], cx.limit)
                .await
        }
        PeerMsg::Ping { t } => w.send(&PeerMsg::Pong { t }, &[], cx.limit).await,
        PeerMsg::Pong { .. } => Ok(()),
        other => {
            let e = PeerError::from(Violation::FromDestination {
                got: Box::new(other),
            });
            let reason = e.to_string();
            let _ = w.send(&PeerMsg::Refused { reason }, &[], cx.limit).await;
            Err(e)
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
    cx: &Serving<'_, S>,
    w: &mut TcpConn,
    pull: Pull,
    ucx: &mut UcxState,
) -> Result<(), PeerError> {
    if let (Some(u), Some(given)) = (cx.peers.ucx(), ucx.given.as_mut())
        && u.generation() != *given
    {
        let (offer, generation) = u
            .offer()
            .map_err(PullError::UcxKey)?
            .ok_or(Violation::ExposureWithdrawn)?;
        w.send(&offer, &[], cx.limit).await?;
        *given = generation;
    }
    serve_pull(cx, w, pull, Delivery::Slots(&mut ucx.held)).await
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
