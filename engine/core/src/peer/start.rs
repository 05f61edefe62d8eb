//! Starting an operation, in four steps, none of which dials before the previous said yes:
//! local lookup (through the store: DRAM, then NVMe), parse + authorize the hint, admit the
//! keys against the peer's in-flight cap (with each tenant's fair share of it: fair.rs),
//! then spawn the chunked pulls and the deadline.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvnode_proto::Key;
use kvnode_proto::hint::{Endpoint, covered_keys, parse_hint};
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome};

use super::Peers;
use super::fetch::{IN_PLACE_KEYS, PeerLink, PullCost, run_chunk};
use super::op::{NewOp, PullOp};
use crate::store::Reservation;

/// A client's request for a hinted pull.
#[derive(Debug)]
pub struct PullRequest<'a> {
    /// Client connection that owns the op.
    pub conn: u64,
    /// Namespace handle.
    pub ns: u32,
    /// Keys, in request order.
    pub keys: &'a [Key],
    /// The router hint (JSON).
    pub hint: &'a str,
    /// Client buffers to fill (alloc handle, reservation), one per key, or none.
    pub into: Vec<(u64, Reservation)>,
    /// Deadline; `None`: the declared timeout for the keys to pull.
    pub deadline_ms: Option<u64>,
    /// Keep each pulled block's commit lease for the caller ([`PullOp::take_leases`]).
    pub hand_leases: bool,
    /// Results of the hint envelope's other actions, carried into the op's report.
    pub actions: Vec<kvnode_proto::actions::ActionResult>,
}

/// A pull left for the caller to drive ([`Peers::start_get`]). A caller that stops waiting
/// spawns it (it goes on into the DRAM tier). Dropped unfinished (its task aborted), the
/// block being received still lands and the link's in-flight count is released, but keys
/// it had not answered stay `Pending` until the op ends.
pub type InlinePull = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where the hint points and how many leading keys it covers.
struct Plan {
    endpoint: Endpoint,
    covered: usize,
}

impl Peers {
    /// Starts a get-with-hint operation and returns once its pulls are under way. A bad or
    /// unauthorized hint yields an ended op whose `reason` says why; local hits (DRAM or
    /// this node's NVMe) are reported either way and never pulled.
    pub async fn start(self: &Arc<Self>, req: PullRequest<'_>) -> Arc<PullOp> {
        self.begin(req, false).await.0
    }

    /// [`Peers::start`] for a caller that waits for the op itself (a `Get` with a hint):
    /// when the pull is one chunk, it is returned to be driven in the caller's task
    /// instead of a task of its own, and no deadline task is started (the caller ends the
    /// op at its deadline, and spawns the pull if it is still running then). Saves the
    /// runtime two task hand-offs per small pull.
    pub async fn start_get(
        self: &Arc<Self>,
        req: PullRequest<'_>,
    ) -> (Arc<PullOp>, Option<InlinePull>) {
        self.begin(req, true).await
    }

    async fn begin(
        self: &Arc<Self>,
        mut req: PullRequest<'_>,
        inline: bool,
    ) -> (Arc<PullOp>, Option<InlinePull>) {
        let local = self.lookup_local(req.ns, req.keys, &mut req.into).await;
        let plan = local
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|_| self.plan(req.hint, req.keys));
        let mut results = local.unwrap_or_else(|_| vec![KeyOutcome::Pending; req.keys.len()]);
        // Keys past the hint's hashes are NotCovered; when the whole op is refused they
        // carry the refusal's code (its message is given once, as the op's reason).
        let (covered, beyond) = match &plan {
            Ok(p) => (
                p.covered,
                Failure::new(FailCode::NotCovered, "not covered by the hint"),
            ),
            Err(why) => (0, Failure::new(why.code, "")),
        };
        for r in results.iter_mut().skip(covered) {
            if *r == KeyOutcome::Pending {
                *r = KeyOutcome::Failed(beyond.clone());
            }
        }
        let pending: Vec<usize> = (0..req.keys.len())
            .filter(|&i| results[i] == KeyOutcome::Pending)
            .collect();
        let deadline = req
            .deadline_ms
            .map_or_else(|| self.stats.deadline(pending.len()), Duration::from_millis);
        let peer = plan.as_ref().ok().map(|p| p.endpoint.to_string());
        let op = PullOp::new(NewOp {
            id: self.ops.next_id(),
            ns: req.ns,
            keys: req.keys.to_vec(),
            conn: req.conn,
            peer,
            results,
            into: req.into,
            deadline,
            hand_leases: req.hand_leases,
            actions: req.actions,
        });
        // Only an op still running when its reply goes out enters the op table: one that
        // ended before (refused, or nothing to pull) is reported in that reply and forgotten.
        let plan = match plan {
            Ok(p) => p,
            Err(why) => {
                self.counters.refused_hints.fetch_add(1, Ordering::Relaxed);
                tracing::info!(op = op.id, reason = %why, "hint refused; serving local hits only");
                op.refuse(&why);
                return (op, None);
            }
        };
        if pending.is_empty() {
            return (op, None);
        }
        if let Err(why) = self.ops.insert(Arc::clone(&op)) {
            op.refuse(&why);
            return (op, None);
        }
        let Some(pending) = self.join_in_flight(&op, pending, deadline, inline) else {
            return (op, None);
        };
        let link = self.link(&plan.endpoint);
        let tenant = self.store().tenants().of_handle(req.ns).unwrap_or(0);
        let n = pending.len() as u64;
        match self.ops.fair.admit(
            super::fair::LinkCount {
                name: &link.name,
                outstanding: &link.outstanding,
            },
            tenant,
            n,
            self.cfg.max_outstanding_keys,
        ) {
            Ok(share) => op.hold(share),
            Err(why) => {
                self.ops.remove(op.id);
                op.refuse(&why);
                return (op, None);
            }
        }
        self.in_flight.register(&op, &pending);
        let run = self.spawn(&link, &op, &pending, deadline, inline);
        (op, run)
    }

    /// Keys of `pending` another op is pulling now are followed, not pulled again
    /// (join.rs); returns the keys left to pull, `None` when none is.
    fn join_in_flight(
        &self,
        op: &Arc<PullOp>,
        pending: Vec<usize>,
        deadline: Duration,
        inline: bool,
    ) -> Option<Vec<usize>> {
        let joined = self.in_flight.find(op.ns, &op.keys, &pending);
        if joined.is_empty() {
            return Some(pending);
        }
        let pending: Vec<usize> = pending
            .into_iter()
            .filter(|i| !joined.iter().any(|j| j.0 == *i))
            .collect();
        tokio::spawn(super::join::follow(
            Arc::clone(self.store()),
            Arc::clone(op),
            joined,
        ));
        if pending.is_empty() {
            if !inline {
                expire_at(op, deadline);
            }
            return None;
        }
        Some(pending)
    }

    /// Per key: `HitLocal` when this node holds it (copied into the client buffer, if the
    /// op has one), else `Pending`.
    async fn lookup_local(
        &self,
        ns: u32,
        keys: &[Key],
        into: &mut [(u64, Reservation)],
    ) -> Result<Vec<KeyOutcome>, Failure> {
        let store = self.store();
        let at = store
            .locate(ns, keys)
            .map_err(|e| Failure::new(FailCode::LocalStore, e.to_string()))?;
        let mut out = Vec::with_capacity(keys.len());
        for (i, (k, l)) in keys.iter().zip(at).enumerate() {
            if !l.is_local() {
                out.push(KeyOutcome::Pending);
                continue;
            }
            let Some((_, dst)) = into.get_mut(i) else {
                out.push(KeyOutcome::HitLocal);
                continue;
            };
            let leased = store.lease(ns, std::slice::from_ref(k)).await;
            out.push(match leased.ok().and_then(|mut v| v.pop().flatten()) {
                Some(b) if b.len() == dst.len() => {
                    dst.bytes_mut().copy_from_slice(b.bytes());
                    KeyOutcome::HitLocal
                }
                Some(b) => KeyOutcome::Failed(Failure::new(
                    FailCode::LocalStore,
                    format!(
                        "local block is {} bytes but the client buffer holds {}",
                        b.len(),
                        dst.len()
                    ),
                )),
                // Evicted between lookup and lease: pull it like any other miss.
                None => KeyOutcome::Pending,
            });
        }
        Ok(out)
    }

    /// Where `hint` points (the peer's name, as its pulls are measured under) and how many
    /// leading `keys` it covers, without dialling anything: for a fetch plan.
    pub fn preview(&self, hint: &str, keys: &[Key]) -> Result<(String, usize), Failure> {
        self.plan(hint, keys)
            .map(|p| (p.endpoint.to_string(), p.covered))
    }

    /// Connections a pull of `n` keys is striped over ([`Peers::spawn`]'s chunks).
    pub fn stripes(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let per = n
            .div_ceil(self.cfg.connections.max(1) as usize)
            .max(self.batch_keys().min(n));
        n.div_ceil(per)
    }

    /// Parses the hint, matches its hashes against the keys and authorizes its endpoint.
    fn plan(&self, hint: &str, keys: &[Key]) -> Result<Plan, Failure> {
        let malformed = |e: &dyn std::fmt::Display| {
            Failure::new(FailCode::MalformedHint, format!("hint refused: {e}"))
        };
        let h = parse_hint(hint).map_err(|e| malformed(&e))?;
        let covered = covered_keys(&h.block_hashes, keys).map_err(|e| malformed(&e))?;
        self.authorize(&h.endpoint).map_err(|f| Failure {
            message: format!("hint refused: {}", f.message),
            ..f
        })?;
        Ok(Plan {
            endpoint: h.endpoint,
            covered,
        })
    }

    /// Spawns one pull per chunk of `pending` (each releases its keys from `outstanding`
    /// when it ends) and the op's deadline; or, `inline` and with one chunk, returns that
    /// chunk's pull to the caller.
    fn spawn(
        self: &Arc<Self>,
        link: &Arc<PeerLink>,
        op: &Arc<PullOp>,
        pending: &[usize],
        deadline: Duration,
        inline: bool,
    ) -> Option<InlinePull> {
        let stripes = self.stripes(pending.len());
        let per = pending.len().div_ceil(stripes);
        let cost = PullCost::new(Arc::clone(self), &link.name, stripes);
        if inline && per >= pending.len() {
            return Some(Box::pin(run_chunk(
                Arc::clone(self),
                Arc::clone(link),
                Arc::clone(op),
                pending.to_vec(),
                pending.len() <= IN_PLACE_KEYS,
                cost,
            )));
        }
        for c in pending.chunks(per) {
            tokio::spawn(run_chunk(
                Arc::clone(self),
                Arc::clone(link),
                Arc::clone(op),
                c.to_vec(),
                false,
                Arc::clone(&cost),
            ));
        }
        expire_at(op, deadline);
        None
    }

    /// Cancels `op`; when this returns no byte is written into its buffers again.
    pub fn cancel(&self, op: &PullOp) {
        op.end(
            kvnode_proto::pull::OpState::Cancelled,
            &Failure::new(FailCode::Cancelled, "cancelled by the client"),
        );
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

/// Ends `op` at its deadline (a task of its own) unless it ends first.
fn expire_at(op: &Arc<PullOp>, deadline: Duration) {
    let timer = Arc::clone(op);
    tokio::spawn(async move {
        timer.wait(deadline).await;
        timer.expire();
    });
}
