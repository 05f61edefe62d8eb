//! Source side: accepts authenticated peers and answers pulls from the local tiers.
//!
//! Each answered block is leased from the moment the pull is read until its last byte is
//! handed to the transport, so it cannot be evicted or reused while it is being sent. A key
//! that lives only on NVMe is promoted into DRAM first (the same path as a client `get`).
//! Each block goes out with its BLAKE3 hash in the sealed header, hashed once per block and
//! remembered ([`super::hashes`]); a block whose bytes changed since is answered `Miss`.

use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::NamespaceId;
use kvnode_proto::peer::{HASH_LEN, PeerMsg, PullKey};
use tokio::sync::watch;

use super::auth::accept_handshake;
use super::hashes::{HashCache, SlotId, fingerprint};
use super::transport::{PeerListener, TcpConn};
use super::{PeerError, Peers};
use crate::store::{Lease, Store};

/// Idle pooled connections are closed after this long without a request.
const IDLE_LIMIT: Duration = Duration::from_mins(10);

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

/// The block's hash: remembered, or computed now and remembered. `None` when its bytes no
/// longer match the fingerprint its slot kept from the first time (changed under a lease).
pub fn block_hash(
    cache: &HashCache,
    ns: NamespaceId,
    k: PullKey,
    b: &Lease,
) -> Option<[u8; HASH_LEN]> {
    let at = |fingerprint| SlotId {
        ns,
        digest: k.0,
        segment: k.1,
        offset: b.extent().offset,
        len: b.len(),
        fingerprint,
    };
    let kept = b.xxh3();
    if let Some(h) = kept.and_then(|f| cache.get(&at(f))) {
        return Some(h);
    }
    let h = *blake3::hash(b.bytes()).as_bytes();
    let f = fingerprint(&h);
    match kept {
        Some(k) if k != f => return None,
        Some(_) => {}
        None => b.remember_checksum(f),
    }
    cache.put(at(f), h);
    Some(h)
}

async fn serve_pull<S: BlockSource>(
    p: &Peers,
    src: &S,
    w: &mut TcpConn,
    req: u64,
    ns: NamespaceId,
    keys: &[PullKey],
    limit: Duration,
) -> Result<(), PeerError> {
    // Each block stays leased until its last byte is handed to the transport; an early
    // return drops the rest.
    let mut leased = src.lease(ns, keys).await;
    for (i, l) in leased.iter_mut().enumerate() {
        let idx = i as u32;
        let hashed = l.take().and_then(|b| {
            let h = block_hash(&p.hashes, ns, keys[i], &b);
            if h.is_none() {
                p.counters
                    .changed_blocks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    len = b.len(),
                    "a block's bytes changed after it was hashed (written through a client mapping?): answered Miss"
                );
            }
            h.map(|h| (b, h))
        });
        match hashed {
            Some((b, hash)) => {
                let bytes = b.bytes();
                let msg = PeerMsg::Block {
                    req,
                    idx,
                    len: bytes.len() as u32,
                    hash: hash.to_vec(),
                    seal: Vec::new(),
                };
                w.send(&msg, bytes, limit).await?;
            }
            None => w.send(&PeerMsg::Miss { req, idx }, &[], limit).await?,
        }
    }
    w.send(&PeerMsg::Done { req }, &[], limit).await
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
    loop {
        let next = tokio::select! {
            r = w.recv(IDLE_LIMIT) => r,
            _ = stop.changed() => return,
        };
        if next.is_ok() && !p.key_held(w.key_id()) {
            tracing::info!(peer = %w.remote(), "closing a session whose cluster key was removed");
            return;
        }
        let r = match next {
            Ok((PeerMsg::Pull { req, ns, keys }, _)) => {
                serve_pull(&p, &src, &mut w, req, ns, &keys, limit).await
            }
            Ok((PeerMsg::Ping { t }, _)) => w.send(&PeerMsg::Pong { t }, &[], limit).await,
            Ok((PeerMsg::Pong { .. }, _)) => Ok(()),
            Ok((other, _)) => {
                let reason = format!("unexpected {other:?} from a destination");
                let _ = w
                    .send(
                        &PeerMsg::Refused {
                            reason: reason.clone(),
                        },
                        &[],
                        limit,
                    )
                    .await;
                Err(PeerError::Protocol(reason))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            match e {
                PeerError::Timeout("peer send", _) => {
                    tracing::warn!(peer = %w.remote(), error = %e, "destination stopped reading; closing and releasing its blocks");
                }
                PeerError::Io(_) | PeerError::Timeout(..) => {
                    tracing::debug!(peer = %w.remote(), error = %e, "peer connection closed");
                }
                PeerError::Frame(_) | PeerError::Integrity(_) => {
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
            return;
        }
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
