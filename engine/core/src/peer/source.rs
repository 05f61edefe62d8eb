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

use super::PeerError;
use super::auth::accept_handshake;
use super::transport::{PeerListener, TcpConn};
use crate::api::Engine;
use crate::policy::SlotId;
use crate::tier::LeasedBlock;

/// Idle pooled connections are closed after this long without a request.
const IDLE_LIMIT: Duration = Duration::from_mins(10);

/// Where a source finds blocks.
pub trait BlockSource: Send + Sync {
    /// Leases each key that is held (`None` for misses).
    fn lease(
        &self,
        ns: NamespaceId,
        keys: &[PullKey],
    ) -> impl Future<Output = Vec<Option<LeasedBlock>>> + Send;
    /// Ends leases taken by `lease`.
    fn release(&self, slots: &[SlotId]);
    /// The bytes of a leased block.
    fn bytes(&self, b: &LeasedBlock) -> &[u8];
    /// Keeps the checksum computed for a leased block, so the next send need not hash it.
    fn remember_checksum(&self, b: &LeasedBlock, xxh3: u64);
}

/// The local tiers as a block source: DRAM, then NVMe misses promoted into DRAM.
#[derive(Debug)]
pub struct TierSource(pub Arc<Engine>);

impl BlockSource for TierSource {
    async fn lease(&self, ns: NamespaceId, keys: &[PullKey]) -> Vec<Option<LeasedBlock>> {
        let e = &self.0;
        let keys: Vec<kvnode_proto::Key> =
            keys.iter().map(|k| kvnode_proto::Key(k.0, k.1)).collect();
        let Some(h) = e.tier.handle_of(ns) else {
            return vec![None; keys.len()];
        };
        let mut leased = e
            .tier
            .lease(h, &keys)
            .unwrap_or_else(|_| vec![None; keys.len()]);
        if let Some(t) = &e.tiering
            && leased.iter().any(Option::is_none)
        {
            t.promote_misses(e, h, &keys, &mut leased).await;
        }
        leased
    }

    fn release(&self, slots: &[SlotId]) {
        self.0.tier.release(slots);
    }

    fn bytes(&self, b: &LeasedBlock) -> &[u8] {
        // SAFETY: the block is leased (committed, immutable, not reusable) until released.
        unsafe { self.0.arena.slice(b.extent.offset, b.extent.len) }
    }

    fn remember_checksum(&self, b: &LeasedBlock, xxh3: u64) {
        self.0.tier.remember_checksum(b, xxh3);
    }
}

/// Releases whatever leases a pull still holds when it ends early.
struct Leases<'a, S: BlockSource> {
    src: &'a S,
    held: Vec<Option<SlotId>>,
}

impl<S: BlockSource> Drop for Leases<'_, S> {
    fn drop(&mut self) {
        let left: Vec<SlotId> = self.held.iter().flatten().copied().collect();
        self.src.release(&left);
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
    let leased = src.lease(ns, keys).await;
    let mut guard = Leases {
        src,
        held: leased.iter().map(|l| l.map(|b| b.slot)).collect(),
    };
    for (idx, l) in leased.iter().enumerate() {
        let idx = idx as u32;
        match l {
            Some(b) => {
                let bytes = src.bytes(b);
                let xxh3 = b.xxh3.unwrap_or_else(|| {
                    let sum = XxHash3_64::oneshot(bytes);
                    src.remember_checksum(b, sum);
                    sum
                });
                let msg = PeerMsg::Block {
                    req,
                    idx,
                    len: bytes.len() as u32,
                    xxh3,
                };
                w.send(&msg, bytes, limit).await?;
                if let Some(slot) = guard.held[idx as usize].take() {
                    src.release(&[slot]);
                }
            }
            None => w.send(&PeerMsg::Miss { req, idx }, &[], limit).await?,
        }
    }
    w.send(&PeerMsg::Done { req }, &[], limit).await
}

async fn serve_conn(engine: Arc<Engine>, mut w: TcpConn, mut stop: watch::Receiver<bool>) {
    let p = &engine.peers;
    let dst = match accept_handshake(&mut w, p.key(), p.node(), p.connect_timeout()).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(peer = %w.remote(), error = %e, "peer refused");
            return;
        }
    };
    tracing::debug!(peer = %w.remote(), node = %dst, "peer authenticated");
    let src = TierSource(Arc::clone(&engine));
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
pub async fn serve(engine: Arc<Engine>, listener: PeerListener, mut stop: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            a = listener.accept() => match a {
                Ok(w) => {
                    conns.spawn(serve_conn(Arc::clone(&engine), w, stop.clone()));
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
