//! Request handlers: one function per op, each answering exactly one reply frame.

use std::io;

use kvnode_proto::Key;
use kvnode_proto::client::{
    AllocSlot, BlockMeta, CommitStatus, ErrorCode, GetMode, Op, PutStatus, Reply, Request,
};
use kvnode_proto::frame::MAX_PAYLOAD;
use kvnode_proto::pull::OpReport;

use super::conn::Connection;
use crate::tier::{Reservation, TierError};

pub(super) fn tier_error(e: &TierError) -> Reply {
    let code = match e {
        TierError::UnknownNamespace(_) => ErrorCode::UnknownNamespace,
        TierError::SlotTooLarge { .. } | TierError::TooManyClasses(_) => ErrorCode::Unsupported,
        _ => ErrorCode::Invalid,
    };
    Reply::Error {
        code,
        message: e.to_string(),
    }
}

pub(super) fn invalid(msg: impl Into<String>) -> Reply {
    Reply::Error {
        code: ErrorCode::Invalid,
        message: msg.into(),
    }
}

impl Connection {
    /// Handles one request whose header is decoded and whose `payload_len` bytes are unread.
    #[expect(
        clippy::too_many_lines,
        reason = "one match arm per protocol op; each arm delegates"
    )]
    pub async fn handle(&mut self, req: Request, payload_len: u64) -> io::Result<()> {
        let id = req.id;
        if payload_len > 0 && !matches!(req.op, Op::Put { .. }) {
            self.io.skip(payload_len).await?;
            return self
                .send(id, invalid("only Put carries a payload"), &[])
                .await;
        }
        let reply = match req.op {
            Op::Hello { .. } => invalid("Hello is only valid as the first frame"),
            Op::Register { spec } => match self.engine.tier.register(&spec) {
                Ok(r) => {
                    tracing::info!(conn = self.id, ns = r.ns, id = %r.id, model = %spec.model, "namespace registered");
                    Reply::Registered {
                        ns: r.ns,
                        id: r.id.to_string(),
                        segments: r.segments,
                    }
                }
                Err(e) => tier_error(&e),
            },
            Op::Put {
                ns,
                keys,
                lens,
                meta,
            } => return self.put(id, ns, &keys, &lens, &meta, payload_len).await,
            Op::Alloc {
                ns,
                keys,
                lens,
                meta,
            } => self.alloc(ns, &keys, &lens, &meta),
            Op::Commit { handles } => self.commit(&handles),
            Op::Abort { handles } => {
                let res: Vec<Reservation> = handles
                    .iter()
                    .filter_map(|h| {
                        self.metas.remove(h);
                        self.reservations.remove(h)
                    })
                    .collect();
                self.engine.tier.abort(self.id, &res);
                Reply::Aborted {
                    count: res.len() as u32,
                }
            }
            Op::Get {
                ns,
                keys,
                mode,
                hint,
                deadline_ms,
            } => {
                let pull = match hint {
                    Some(h) => Some(Box::new(self.get_pull(ns, &keys, &h, deadline_ms).await)),
                    None => None,
                };
                return self.get(id, ns, &keys, mode, pull).await;
            }
            Op::Release { lease } => match self.leases.remove(&lease) {
                Some(slots) => {
                    self.watch.lease_end(lease);
                    self.engine.tier.release(&slots);
                    Reply::Released
                }
                None => Reply::Error {
                    code: ErrorCode::NotOwned,
                    message: format!(
                        "lease {lease} is not held by this connection (already released?)"
                    ),
                },
            },
            Op::Exists { ns, keys, hint } => match self.engine.exists(ns, &keys) {
                Ok(count) => Reply::Exists {
                    count,
                    pull: hint.map(|h| Box::new(self.exists_pull(ns, &keys, &h))),
                },
                Err(e) => tier_error(&e),
            },
            Op::Delete { ns, keys } => match self.engine.delete(ns, &keys) {
                Ok(count) => Reply::Deleted { count },
                Err(e) => tier_error(&e),
            },
            Op::Clear { ns } => match self.engine.clear(ns) {
                Ok(count) => {
                    tracing::info!(conn = self.id, ?ns, count, "cleared");
                    Reply::Cleared { count }
                }
                Err(e) => tier_error(&e),
            },
            Op::Stats => Reply::Stats(Box::new(self.engine.stats())),
            Op::Pull {
                ns,
                keys,
                hint,
                into,
                deadline_ms,
            } => self.pull_op(ns, &keys, &hint, &into, deadline_ms),
            Op::Wait { op, timeout_ms } => self.wait_op(op, timeout_ms).await,
            Op::Cancel { op } => self.cancel_op(op),
            Op::Timeouts => Reply::Timeouts(Box::new(self.engine.peers.stats.report())),
            Op::Histograms => Reply::Histograms(Box::new(self.engine.metrics.report())),
            Op::AttachRegion { len } => self.attach_region(len),
            Op::DetachRegion { region } => self.detach_region(region),
            Op::GetToRegion {
                ns,
                keys,
                region,
                offsets,
                lens,
                hint,
                deadline_ms,
            } => {
                let pull = match hint {
                    Some(h) => Some(Box::new(self.get_pull(ns, &keys, &h, deadline_ms).await)),
                    None => None,
                };
                let mut reply = self.get_to_region(ns, &keys, region, &offsets, &lens).await;
                if let Reply::GotToRegion { pull: p, .. } = &mut reply {
                    *p = pull;
                }
                reply
            }
            Op::PutFromRegion {
                ns,
                keys,
                region,
                offsets,
                lens,
            } => {
                self.put_from_region(ns, &keys, region, &offsets, &lens)
                    .await
            }
            op @ (Op::AttachGpu(_)
            | Op::Offload(_)
            | Op::Onload(_)
            | Op::OnloadAsync(_)
            | Op::OnloadWait { .. }
            | Op::OnloadCancel { .. }) => self.gpu_op(op).await,
        };
        self.send(id, reply, &[]).await
    }

    async fn put(
        &mut self,
        id: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
        meta: &[Option<BlockMeta>],
        payload_len: u64,
    ) -> io::Result<()> {
        let sum: Option<u64> = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l));
        if keys.len() != lens.len() || sum != Some(payload_len) {
            self.io.skip(payload_len).await?;
            let msg = format!(
                "{} keys, {} lengths summing to {sum:?}, but the payload is {payload_len} bytes",
                keys.len(),
                lens.len()
            );
            return self.send(id, invalid(msg), &[]).await;
        }
        let metas = match super::meta::router_metas(&self.engine, ns, keys, meta) {
            Ok(m) => m,
            Err(msg) => {
                self.io.skip(payload_len).await?;
                return self.send(id, invalid(msg), &[]).await;
            }
        };
        if let Some(t) = &self.engine.tiering {
            t.make_room(&self.engine, payload_len).await;
        }
        let reserved = match self.engine.tier.reserve(self.id, ns, keys, lens) {
            Ok(r) => r,
            Err(e) => {
                self.io.skip(payload_len).await?;
                return self.send(id, tier_error(&e), &[]).await;
            }
        };
        // Bytes go straight from the socket into the reserved slots.
        let mut held: Vec<Reservation> = reserved
            .iter()
            .filter_map(|r| r.as_ref().ok().copied())
            .collect();
        for (r, &len) in reserved.iter().zip(lens) {
            let read = match r {
                // SAFETY: this connection holds the reservation; no one else touches the slot.
                Ok(res) => self
                    .io
                    .read_exact(unsafe { self.engine.arena.slice_mut(res.offset, len) })
                    .await
                    .map(|_| ()),
                Err(_) => self.io.skip(len).await,
            };
            if let Err(e) = read {
                self.engine.tier.abort(self.id, &held);
                return Err(e);
            }
        }
        let with_meta: Vec<_> = reserved
            .iter()
            .zip(metas)
            .filter_map(|(r, m)| r.as_ref().ok().map(|r| (*r, m)))
            .collect();
        let committed = self.engine.tier.commit_with(self.id, &with_meta, false);
        held.clear();
        let mut it = committed.into_iter();
        let results = reserved
            .iter()
            .map(|r| match r {
                Err(status) => *status,
                Ok(_) => match it.next() {
                    Some(CommitStatus::Committed) => PutStatus::Stored,
                    _ => PutStatus::Exists,
                },
            })
            .collect();
        self.send(id, Reply::Put { results }, &[]).await
    }

    fn alloc(&mut self, ns: u32, keys: &[Key], lens: &[u64], meta: &[Option<BlockMeta>]) -> Reply {
        let metas = match super::meta::router_metas(&self.engine, ns, keys, meta) {
            Ok(m) => m,
            Err(msg) => return invalid(msg),
        };
        let reserved = match self.engine.tier.reserve(self.id, ns, keys, lens) {
            Ok(r) => r,
            Err(e) => return tier_error(&e),
        };
        let slots = reserved
            .into_iter()
            .zip(metas)
            .map(|(r, m)| match r {
                Ok(res) => {
                    let handle = self.next_handle;
                    self.next_handle += 1;
                    self.reservations.insert(handle, res);
                    if let Some(m) = m {
                        self.metas.insert(handle, m);
                    }
                    AllocSlot::Granted {
                        handle,
                        offset: res.offset,
                        len: res.len,
                    }
                }
                Err(status) => AllocSlot::Refused { status },
            })
            .collect();
        Reply::Alloc { slots }
    }

    fn commit(&mut self, handles: &[u64]) -> Reply {
        let found: Vec<Option<Reservation>> = handles
            .iter()
            .map(|h| self.reservations.remove(h))
            .collect();
        let known: Vec<_> = handles
            .iter()
            .zip(&found)
            .filter_map(|(h, f)| f.map(|r| (r, self.metas.remove(h))))
            .collect();
        let mut done = self
            .engine
            .tier
            .commit_with(self.id, &known, false)
            .into_iter();
        let results = found
            .iter()
            .map(|f| match f {
                Some(_) => done.next().unwrap_or(CommitStatus::UnknownHandle),
                None => CommitStatus::UnknownHandle,
            })
            .collect();
        Reply::Commit { results }
    }

    async fn get(
        &mut self,
        id: u64,
        ns: u32,
        keys: &[Key],
        mode: GetMode,
        pull: Option<Box<OpReport>>,
    ) -> io::Result<()> {
        let mut leased = match self.engine.tier.lease(ns, keys) {
            Ok(l) => l,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        if let Some(t) = &self.engine.tiering {
            t.promote_misses(&self.engine, ns, keys, &mut leased).await;
        }
        let slots: Vec<_> = leased.iter().flatten().map(|l| l.slot).collect();
        match mode {
            GetMode::Lease => {
                let lease = if slots.is_empty() {
                    0
                } else {
                    let l = self.next_handle;
                    self.next_handle += 1;
                    let now = self.engine.metrics.now_ns();
                    self.watch.lease_begin(l, slots.len() as u64, now);
                    self.leases.insert(l, slots);
                    l
                };
                let extents = leased.iter().map(|l| l.map(|b| b.extent)).collect();
                let reply = Reply::GetLease {
                    lease,
                    extents,
                    pull,
                };
                self.send(id, reply, &[]).await
            }
            GetMode::Inline => {
                let total: u64 = leased.iter().flatten().map(|l| l.extent.len).sum();
                if total > u64::from(MAX_PAYLOAD) {
                    self.engine.tier.release(&slots);
                    let msg = format!(
                        "{total} bytes found exceed the 1 GiB frame limit: split the batch or use Lease mode"
                    );
                    return self.send(id, invalid(msg), &[]).await;
                }
                let engine = std::sync::Arc::clone(&self.engine);
                // SAFETY: every extent is leased until the release below, so its bytes are
                // committed and immutable while they are written to the socket.
                let payload: Vec<&[u8]> = leased
                    .iter()
                    .flatten()
                    .map(|l| unsafe { engine.arena.slice(l.extent.offset, l.extent.len) })
                    .collect();
                let lens = leased.iter().map(|l| l.map(|b| b.extent.len)).collect();
                let r = self
                    .send(id, Reply::GetInline { lens, pull }, &payload)
                    .await;
                drop(payload);
                self.engine.tier.release(&slots);
                r
            }
        }
    }
}
