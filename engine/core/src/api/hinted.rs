//! Client ops of the peer path: get/exists with a hint, `Pull`, `Wait`, `Cancel`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_proto::Key;
use kvnode_proto::client::{ErrorCode, Op, Reply};
use kvnode_proto::pull::OpReport;

use super::errors::error;
use super::listed_op::ListedOp;
use super::session::Session;
use crate::peer::{Peers, PullOp, PullRequest};
use crate::store::Reservation;

/// Longest `Wait` accepted.
const MAX_WAIT: Duration = Duration::from_mins(10);

impl Session {
    /// `Pull`, `Wait`, `Cancel`.
    pub(super) async fn peer_op(&mut self, op: Op) -> Reply {
        match op {
            Op::Pull {
                ns,
                keys,
                hint,
                into,
                deadline_ms,
            } => self.pull_op(ns, &keys, &hint, &into, deadline_ms).await,
            Op::Wait { op, timeout_ms } => self.wait_op(op, timeout_ms).await,
            Op::Cancel { op } => self.cancel_op(op),
            other => unreachable!("peer_op got {other:?}"),
        }
    }

    /// A pull for `keys` following `hint`, with the envelope's other actions executed and
    /// their results carried into the op's report (act.rs).
    pub(super) async fn request<'a>(
        &mut self,
        ns: u32,
        keys: &'a [Key],
        hint: &'a str,
    ) -> PullRequest<'a> {
        PullRequest {
            actions: self.side_actions(ns, keys, Some(hint)).await,
            ..self.plain_request(ns, keys, hint)
        }
    }

    /// A pull for `keys` following `hint` alone.
    pub(super) fn plain_request<'a>(
        &self,
        ns: u32,
        keys: &'a [Key],
        hint: &'a str,
    ) -> PullRequest<'a> {
        PullRequest {
            conn: self.id,
            ns,
            keys,
            hint,
            into: Vec::new(),
            deadline_ms: None,
            hand_leases: false,
            actions: Vec::new(),
        }
    }

    /// Runs a get's hinted pull up to its deadline and reports it. Blocks still in flight
    /// at the deadline keep landing in the DRAM tier and become local hits later.
    pub(super) async fn get_pull(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: &str,
        deadline_ms: Option<u64>,
    ) -> OpReport {
        let peers = Arc::clone(&self.engine.peers);
        let (op, inline) = peers
            .start_get(PullRequest {
                deadline_ms,
                hand_leases: false,
                ..self.request(ns, keys, hint).await
            })
            .await;
        if let Some(mut run) = inline {
            let left = op.deadline.saturating_duration_since(Instant::now());
            tokio::select! {
                () = &mut run => {}
                // Past the deadline the pull goes on in a task of its own.
                () = tokio::time::sleep(left) => drop(tokio::spawn(run)),
            }
        }
        let op = ListedOp::new(peers, op);
        op.wait(op.deadline.saturating_duration_since(Instant::now()))
            .await;
        op.expire();
        op.report()
    }

    /// For a `Get`/`GetToRegion` with a hint: its pull report (none without a hint).
    pub(super) async fn hinted_pull(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
        deadline_ms: Option<u64>,
    ) -> Option<Box<OpReport>> {
        match hint {
            Some(h) => Some(Box::new(self.get_pull(ns, keys, h, deadline_ms).await)),
            None => None,
        }
    }

    /// Starts a background pull for `Exists` with a hint.
    pub(super) async fn exists_pull(&mut self, ns: u32, keys: &[Key], hint: &str) -> OpReport {
        let req = self.request(ns, keys, hint).await;
        background_pull(&self.engine.peers, req).await
    }

    /// `Pull`: an async op, optionally filling the client's Alloc'd slots.
    async fn pull_op(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: &str,
        into: &[u64],
        deadline_ms: Option<u64>,
    ) -> Reply {
        if !into.is_empty() && into.len() != keys.len() {
            let msg = format!("{} keys but {} into handles", keys.len(), into.len());
            return error(ErrorCode::Invalid, msg);
        }
        for (h, k) in into.iter().zip(keys) {
            match self.reservations.get(h) {
                None => {
                    let msg = format!("alloc handle {h} is not held by this connection");
                    return error(ErrorCode::NotOwned, msg);
                }
                Some(r) if r.ns() != ns || r.key().digest != k.0 || r.key().segment != k.1 => {
                    let msg = format!("alloc handle {h} was reserved for another key");
                    return error(ErrorCode::Invalid, msg);
                }
                Some(_) => {}
            }
        }
        // The op owns these buffers until it ends; the client cannot commit or abort them.
        let owned: Vec<(u64, Reservation)> = into
            .iter()
            .map(|h| (*h, self.reservations.remove(h).expect("checked above")))
            .collect();
        let peers = Arc::clone(&self.engine.peers);
        let op = peers
            .start(PullRequest {
                into: owned,
                deadline_ms,
                hand_leases: false,
                ..self.request(ns, keys, hint).await
            })
            .await;
        let r = op.report();
        if r.state.is_terminal() {
            self.finish(&op);
        }
        Reply::Op(Box::new(r))
    }

    fn lookup(&self, id: u64) -> Result<Arc<PullOp>, Reply> {
        // Ops belong to the connection that started them: another connection can neither
        // wait for nor cancel them (ids are sequential, so they are guessable).
        match self.engine.peers.ops.get(id) {
            Some(op) if op.conn == self.id => Ok(op),
            Some(_) => Err(error(
                ErrorCode::NotOwned,
                format!("op {id} belongs to another connection"),
            )),
            None => Err(error(
                ErrorCode::Invalid,
                format!("no operation {id} (unknown, or already reported as ended)"),
            )),
        }
    }

    /// Hands an ended op's buffers back to this connection and forgets the op.
    fn finish(&mut self, op: &PullOp) {
        self.reservations.extend(op.take_into());
        self.engine.peers.ops.remove(op.id);
    }

    async fn wait_op(&mut self, id: u64, timeout_ms: u64) -> Reply {
        let op = match self.lookup(id) {
            Ok(op) => op,
            Err(r) => return r,
        };
        op.wait(Duration::from_millis(timeout_ms).min(MAX_WAIT))
            .await;
        let r = op.report();
        if r.state.is_terminal() {
            self.finish(&op);
        }
        Reply::Op(Box::new(r))
    }

    /// `Cancel`: the reply is sent only after the fence is in force.
    fn cancel_op(&mut self, id: u64) -> Reply {
        let op = match self.lookup(id) {
            Ok(op) => op,
            Err(r) => return r,
        };
        let t0 = self.engine.metrics.now_ns();
        crate::probes::cancel(self.id, id, op.report().results.len() as u32);
        self.engine.peers.cancel(&op);
        self.finish(&op);
        crate::probes::fence(self.id, id, self.engine.metrics.now_ns().saturating_sub(t0));
        Reply::Op(Box::new(op.report()))
    }
}

/// Starts `req`'s pull and reports it: an op still running stays in the op table for its
/// connection's `Wait`; one already ended is reported here and forgotten.
pub(super) async fn background_pull(peers: &Arc<Peers>, req: PullRequest<'_>) -> OpReport {
    let op = peers.start(req).await;
    let r = op.report();
    if r.state.is_terminal() {
        // This reply is its final report: nothing is left to `Wait` for.
        peers.ops.remove(op.id);
    }
    r
}
