//! Starting an operation: local lookup, hint validation, hash matching and authorization
//! (all before any connection), then chunked pulls with a deadline.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvnode_proto::Key;
use kvnode_proto::hint::{covered_keys, parse_hint};
use kvnode_proto::pull::{KeyOutcome, OpState};

use super::Peers;
use super::fetch::run_chunk;
use super::op::PullOp;
use crate::api::Engine;
use crate::tier::Reservation;

/// Copies a local block into a client buffer before the op exists (the caller owns `r`).
fn copy_local(engine: &Engine, ns: u32, k: Key, r: &Reservation) -> Result<(), String> {
    let leased = engine.tier.lease(ns, &[k]).map_err(|e| e.to_string())?;
    let Some(Some(b)) = leased.first().copied() else {
        return Err("block vanished before it could be copied".into());
    };
    let res = if b.extent.len == r.len {
        // SAFETY: the block is leased (immutable); the caller owns the reservation `r`.
        let src = unsafe { engine.arena.slice(b.extent.offset, b.extent.len) };
        unsafe { engine.arena.slice_mut(r.offset, r.len) }.copy_from_slice(src);
        Ok(())
    } else {
        Err(format!(
            "local block is {} bytes but the client buffer holds {}",
            b.extent.len, r.len
        ))
    };
    engine.tier.release(&[b.slot]);
    res
}

impl Peers {
    /// Starts a get-with-hint operation and returns at once. A bad or unauthorized hint
    /// yields an ended op whose `reason` says why; local hits are reported either way.
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site per client op; a struct would only rename them"
    )]
    pub fn start(
        &self,
        engine: &Arc<Engine>,
        conn: u64,
        ns: u32,
        keys: &[Key],
        hint: &str,
        into: Vec<(u64, Reservation)>,
        deadline_ms: Option<u64>,
    ) -> Arc<PullOp> {
        let mut results = Vec::with_capacity(keys.len());
        let mut refusal: Option<String> = None;
        for (i, k) in keys.iter().enumerate() {
            match engine.tier.exists(ns, std::slice::from_ref(k)) {
                Ok(1) => match into.get(i).map(|(_, r)| copy_local(engine, ns, *k, r)) {
                    Some(Err(e)) => results.push(KeyOutcome::Failed(e)),
                    _ => results.push(KeyOutcome::HitLocal),
                },
                Ok(_) => results.push(KeyOutcome::Pending),
                Err(e) => {
                    refusal.get_or_insert(e.to_string());
                    results.push(KeyOutcome::Pending);
                }
            }
        }
        let parsed = parse_hint(hint).map_err(|e| format!("hint refused: {e}"));
        let plan = parsed.and_then(|h| {
            let covered =
                covered_keys(&h.block_hashes, keys).map_err(|e| format!("hint refused: {e}"))?;
            self.authorize(&h.endpoint)
                .map_err(|e| format!("hint refused: {e}"))?;
            Ok((h.endpoint, covered))
        });
        let plan = match (refusal, plan) {
            (Some(r), _) | (None, Err(r)) => Err(r),
            (None, Ok(p)) => Ok(p),
        };
        let id = self.ops.next_id();
        let (peer, covered) = match &plan {
            Ok((e, c)) => (Some(e.to_string()), *c),
            Err(_) => (None, 0),
        };
        for (i, r) in results.iter_mut().enumerate() {
            if i >= covered && *r == KeyOutcome::Pending {
                *r = KeyOutcome::Failed("not covered by the hint".into());
            }
        }
        let pending: Vec<usize> = (0..keys.len())
            .filter(|&i| results[i] == KeyOutcome::Pending)
            .collect();
        let deadline =
            deadline_ms.map_or_else(|| self.stats.deadline(pending.len()), Duration::from_millis);
        let op = PullOp::new(id, ns, keys.to_vec(), conn, peer, results, into, deadline);
        self.ops.insert(Arc::clone(&op));
        let (endpoint, _) = match plan {
            Ok(p) => p,
            Err(why) => {
                self.counters.refused_hints.fetch_add(1, Ordering::Relaxed);
                tracing::info!(op = id, reason = %why, "hint refused; serving local hits only");
                op.refuse(&why);
                return op;
            }
        };
        if pending.is_empty() {
            return op;
        }
        let link = self.link(&endpoint);
        let n = pending.len() as u64;
        let before = link.outstanding.fetch_add(n, Ordering::Relaxed);
        if before + n > u64::from(self.cfg.max_outstanding_keys) {
            link.outstanding.fetch_sub(n, Ordering::Relaxed);
            let why = format!(
                "peer {} already has {before} keys in flight (limit {}): not adding {n} more",
                link.name, self.cfg.max_outstanding_keys
            );
            op.refuse(&why);
            return op;
        }
        let per = pending
            .len()
            .div_ceil(self.cfg.connections as usize)
            .max(self.batch_keys().min(pending.len()));
        for c in pending.chunks(per) {
            // Each chunk releases its own keys from `outstanding` when it ends.
            tokio::spawn(run_chunk(
                Arc::clone(engine),
                Arc::clone(&link),
                Arc::clone(&op),
                c.to_vec(),
            ));
        }
        let timer = Arc::clone(&op);
        tokio::spawn(async move {
            timer.wait(deadline).await;
            timer.end(
                OpState::Failed,
                "deadline passed; the transfer continues into the DRAM tier",
            );
        });
        op
    }

    /// Cancels `op`; when this returns no byte is written into its buffers again.
    pub fn cancel(&self, op: &PullOp) {
        op.end(OpState::Cancelled, "cancelled by the client");
    }

    /// Cancels every op of a closing connection and hands back their client buffers.
    pub fn cancel_conn(&self, conn: u64) -> Vec<(u64, Reservation)> {
        let mut back = Vec::new();
        for op in self.ops.of_conn(conn) {
            self.cancel(&op);
            back.extend(op.take_into());
            self.ops.remove(op.id);
        }
        back
    }
}
