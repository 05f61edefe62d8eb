//! Source side: accepts authenticated peers and answers pulls from the local tiers.
//!
//! Each answered block is leased from the moment the pull is read until its last byte is
//! handed to the transport, so it cannot be evicted or reused while it is being sent. A key
//! that lives only on NVMe is promoted into DRAM first (the same path as a client `get`).

use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::NamespaceId;
use kvnode_proto::peer::{PeerMsg, PullKey};
use tokio::sync::watch;
use twox_hash::XxHash3_64;

use super::auth::accept_handshake;
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

async fn serve_pull<S: BlockSource>(
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
    for (idx, l) in leased.iter_mut().enumerate() {
        let idx = idx as u32;
        match l.take() {
            Some(b) => {
                let bytes = b.bytes();
                let xxh3 = b.xxh3().unwrap_or_else(|| {
                    let sum = XxHash3_64::oneshot(bytes);
                    b.remember_checksum(sum);
                    sum
                });
                let msg = PeerMsg::Block {
                    req,
                    idx,
                    len: bytes.len() as u32,
                    xxh3,
                };
                w.send(&msg, bytes, limit).await?;
            }
            None => w.send(&PeerMsg::Miss { req, idx }, &[], limit).await?,
        }
    }
    w.send(&PeerMsg::Done { req }, &[], limit).await
}

async fn serve_conn(p: Arc<Peers>, mut w: TcpConn, mut stop: watch::Receiver<bool>) {
    let dst = match accept_handshake(&mut w, p.key(), p.node(), p.connect_timeout()).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(peer = %w.remote(), error = %e, "peer refused");
            return;
        }
    };
    tracing::debug!(peer = %w.remote(), node = %dst, "peer authenticated");
    let src = Arc::clone(p.store());
    let limit = p.io_timeout();
    loop {
        let next = tokio::select! {
            r = w.recv(IDLE_LIMIT) => r,
            _ = stop.changed() => return,
        };
        let r = match next {
            Ok((PeerMsg::Pull { req, ns, keys }, _)) => {
                serve_pull(&src, &mut w, req, ns, &keys, limit).await
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
                PeerError::Frame(_) => {
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
