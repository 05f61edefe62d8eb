//! Block ops: register, put, get, alloc/commit/abort, release, exists, delete, clear.
//! Every lookup goes through the store; every slot is held by a guard.

use std::io;
use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::{AllocSlot, BlockMeta, CommitStatus, ErrorCode, Op, PutStatus, Reply};

use super::errors::{error, invalid, tier_error};
use super::meta::router_metas;
use super::session::Session;

/// Per key: the put status a commit result means for a key that got a slot.
fn put_status(c: CommitStatus) -> PutStatus {
    match c {
        CommitStatus::Committed => PutStatus::Stored,
        _ => PutStatus::Exists,
    }
}

impl Session {
    /// `Put` and `Get`: ops that move bytes through the socket and write their own reply.
    pub(super) async fn data_io(&mut self, id: u64, op: Op, payload_len: u64) -> io::Result<()> {
        match op {
            Op::Put {
                ns,
                keys,
                lens,
                meta,
            } => self.put(id, ns, &keys, &lens, &meta, payload_len).await,
            Op::Get {
                ns,
                keys,
                mode,
                hint,
                deadline_ms,
            } => {
                let pull = self
                    .hinted_pull(ns, &keys, hint.as_deref(), deadline_ms)
                    .await;
                self.get(id, ns, &keys, mode, pull).await
            }
            other => unreachable!("data_io got {other:?}"),
        }
    }

    /// Block ops answered with one reply and no payload.
    pub(super) async fn data_op(&mut self, op: Op) -> Reply {
        let store = Arc::clone(&self.engine.store);
        match op {
            Op::Register { spec } => match store.register(&self.scoped(&spec)) {
                Ok(r) => {
                    store.tenants().bind(r.ns, r.id, self.tenant);
                    tracing::info!(conn = self.id, ns = r.ns, id = %r.id, model = %spec.model, tenant = self.tenant, "namespace registered");
                    Reply::Registered {
                        ns: r.ns,
                        id: r.id.to_string(),
                        segments: r.segments,
                    }
                }
                Err(e) => tier_error(&e),
            },
            Op::Alloc {
                ns,
                keys,
                lens,
                meta,
            } => self.alloc(ns, &keys, &lens, &meta),
            Op::Commit { handles } => self.commit(&handles),
            Op::Abort { handles } => {
                // Dropping a reservation frees its slot unpublished.
                let count = handles
                    .iter()
                    .filter_map(|h| self.reservations.remove(h))
                    .count();
                Reply::Aborted {
                    count: count as u32,
                }
            }
            Op::Release { lease } => match self.leases.remove(&lease) {
                Some(_) => {
                    self.watch.lease_end(lease);
                    Reply::Released
                }
                None => error(
                    ErrorCode::NotOwned,
                    format!("lease {lease} is not held by this connection (already released?)"),
                ),
            },
            Op::Exists {
                ns,
                keys,
                hint,
                recompute,
            } => self.exists_op(ns, &keys, hint.as_deref(), recompute).await,
            Op::Delete { ns, keys } => match store.delete(ns, &keys) {
                Ok(count) => Reply::Deleted { count },
                Err(e) => tier_error(&e),
            },
            Op::Touch { ns, keys } => match store.touch(ns, &keys) {
                Ok(count) => Reply::Touched { count },
                Err(e) => tier_error(&e),
            },
            Op::Clear { ns } => match store.clear(ns) {
                Ok(count) => {
                    tracing::info!(conn = self.id, ?ns, count, "cleared");
                    Reply::Cleared { count }
                }
                Err(e) => tier_error(&e),
            },
            other => unreachable!("data_op got {other:?}"),
        }
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
        let store = Arc::clone(&self.engine.store);
        let metas = match router_metas(&self.engine, ns, keys, meta) {
            Ok(m) => m,
            Err(msg) => {
                self.io.skip(payload_len).await?;
                return self.send(id, invalid(msg), &[]).await;
            }
        };
        // Run by run: each waits for DRAM room (demotion to NVMe paces a put larger than
        // DRAM), then bytes go straight from the socket into the reserved slots. An error
        // drops the reservations, which frees their slots. The payload has a deadline
        // (`payload_deadline`): a client that stalls holding reservations is cut off.
        let mut results = Vec::with_capacity(keys.len());
        let mut metas = metas.into_iter();
        let mut deadline = self.payload_deadline(payload_len);
        for run in store.put_runs(lens) {
            let (ks, ls) = (&keys[run.clone()], &lens[run.clone()]);
            let waited = tokio::time::Instant::now();
            store.make_room(ls.iter().sum()).await;
            deadline += waited.elapsed();
            let mut reserved = match store.reserve(self.id, ns, ks, ls) {
                Ok(r) => r,
                Err(e) => {
                    let left: u64 = lens[run.start..].iter().sum();
                    self.io.skip(left).await?;
                    return self.send(id, tier_error(&e), &[]).await;
                }
            };
            for (r, &len) in reserved.iter_mut().zip(ls) {
                let read = match r {
                    Ok(res) => {
                        let read = self.io.read_exact(res.bytes_mut());
                        tokio::time::timeout_at(deadline, read)
                            .await
                            .map(|r| r.map(|_| ()))
                    }
                    Err(_) => tokio::time::timeout_at(deadline, self.io.skip(len)).await,
                };
                match read {
                    Ok(r) => r?,
                    Err(_) => return Err(self.payload_timed_out(payload_len)),
                }
            }
            results.extend(
                reserved
                    .into_iter()
                    .zip(metas.by_ref())
                    .map(|(r, m)| match r {
                        Err(status) => status,
                        Ok(mut res) => {
                            res.set_meta(m);
                            put_status(res.commit())
                        }
                    }),
            );
        }
        self.send(id, Reply::Put { results }, &[]).await
    }

    /// When a put's payload of `len` bytes must have arrived: `put_payload_timeout_s` plus
    /// one second per 64 MiB from now (pushed back by the daemon's own waits for room).
    fn payload_deadline(&self, len: u64) -> tokio::time::Instant {
        let base = self.engine.config.put_payload_timeout_s;
        let per_byte = 1.0 / f64::from(64u32 << 20);
        #[expect(
            clippy::cast_precision_loss,
            reason = "a deadline: a rounding of the payload length does not matter"
        )]
        let secs = base + len as f64 * per_byte;
        tokio::time::Instant::now() + std::time::Duration::from_secs_f64(secs)
    }

    /// A put's payload missed its deadline: counted, logged; the error closes the
    /// connection, whose drop frees the reservations still held.
    fn payload_timed_out(&self, len: u64) -> io::Error {
        self.engine.metrics.put_payload_timed_out();
        tracing::warn!(
            conn = self.id,
            pid = self.cred.pid,
            uid = self.cred.uid,
            payload = len,
            "put payload did not arrive in time; closing the connection and freeing its reservations (kvnode_put_payload_timeouts_total)"
        );
        io::Error::new(
            io::ErrorKind::TimedOut,
            "put payload did not arrive within put_payload_timeout_s",
        )
    }

    fn alloc(&mut self, ns: u32, keys: &[Key], lens: &[u64], meta: &[Option<BlockMeta>]) -> Reply {
        let store = Arc::clone(&self.engine.store);
        let metas = match router_metas(&self.engine, ns, keys, meta) {
            Ok(m) => m,
            Err(msg) => return invalid(msg),
        };
        let reserved = match store.reserve(self.id, ns, keys, lens) {
            Ok(r) => r,
            Err(e) => return tier_error(&e),
        };
        let slots = reserved
            .into_iter()
            .zip(metas)
            .map(|(r, m)| match r {
                Ok(res) => {
                    let (offset, len) = (res.offset(), res.len());
                    let handle = self.hold(res, m);
                    AllocSlot::Granted {
                        handle,
                        offset,
                        len,
                    }
                }
                Err(status) => AllocSlot::Refused { status },
            })
            .collect();
        Reply::Alloc { slots }
    }

    fn commit(&mut self, handles: &[u64]) -> Reply {
        let results = handles
            .iter()
            .map(|h| match self.reservations.remove(h) {
                Some(r) => r.commit(),
                None => CommitStatus::UnknownHandle,
            })
            .collect();
        Reply::Commit { results }
    }
}
