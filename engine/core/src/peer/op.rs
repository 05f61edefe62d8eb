//! Pull operations: per-key outcomes, deadline, and the buffer fence.
//!
//! An op may own client buffers (`into`: Alloc reservations). Every write into them happens
//! under the op's mutex and only while the op is not terminal; cancel, deadline and
//! completion make it terminal under the same mutex. So once `cancel` has returned, no byte
//! is written into those buffers again. Blocks that arrive later still land in the daemon's
//! own DRAM slots (see `fetch`), never in the op's buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvnode_proto::Key;
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome, OpReport, OpState};
use tokio::sync::watch;

use super::fair::{FairShares, Share};
use crate::store::{Lease, Reservation};

#[derive(Debug)]
struct Inner {
    results: Vec<KeyOutcome>,
    state: OpState,
    reason: Option<Failure>,
    /// Client buffers: (alloc handle, reservation) per key.
    into: Vec<(u64, Reservation)>,
    pending: usize,
    ended: Option<Instant>,
    /// Its tenant's keys in flight to the peer (fair.rs): one given back per key answered,
    /// the rest when the op ends.
    share: Option<Share>,
    /// For a consumer that copies pulled blocks onward: the lease each pulled block's commit
    /// took, kept until the consumer takes it ([`PullOp::take_leases`]); `None`: not kept.
    handed: Option<Vec<Option<Lease>>>,
}

/// One operation.
#[derive(Debug)]
pub struct PullOp {
    /// Id.
    pub id: u64,
    /// Destination namespace handle.
    pub ns: u32,
    /// Keys, in request order.
    pub keys: Vec<Key>,
    /// Owning client connection.
    pub conn: u64,
    /// Peer endpoint, if a pull was started.
    pub peer: Option<String>,
    /// Results of the request's other router actions.
    actions: Vec<kvnode_proto::actions::ActionResult>,
    /// Deadline.
    pub deadline: Instant,
    started: Instant,
    inner: Mutex<Inner>,
    done: watch::Sender<bool>,
    /// Bumped on every change of a key's outcome and when the op ends (see [`PullOp::landed`]).
    changes: watch::Sender<u64>,
}

/// What a new op is made of ([`PullOp::new`]).
#[derive(Debug)]
pub struct NewOp {
    /// Id.
    pub id: u64,
    /// Destination namespace handle.
    pub ns: u32,
    /// Keys, in request order.
    pub keys: Vec<Key>,
    /// Owning client connection.
    pub conn: u64,
    /// Peer endpoint, if a pull is to be started.
    pub peer: Option<String>,
    /// Each key's outcome so far (`Pending`: to be pulled).
    pub results: Vec<KeyOutcome>,
    /// Client buffers: (alloc handle, reservation) per key.
    pub into: Vec<(u64, Reservation)>,
    /// Time from now to the op's deadline.
    pub deadline: Duration,
    /// Keep each pulled block's lease from its commit for the consumer
    /// ([`PullOp::take_leases`]), so it need not look the block up again.
    pub hand_leases: bool,
    /// Results of the request's other router actions (reported as they are).
    pub actions: Vec<kvnode_proto::actions::ActionResult>,
}

fn leading(r: &[KeyOutcome]) -> u32 {
    r.iter()
        .take_while(|o| matches!(o, KeyOutcome::HitLocal | KeyOutcome::Pulled))
        .count() as u32
}

impl PullOp {
    /// A new op; keys marked `Pending` are to be pulled.
    pub fn new(o: NewOp) -> Arc<Self> {
        let NewOp {
            id,
            ns,
            keys,
            conn,
            peer,
            results,
            into,
            deadline,
            hand_leases,
            actions,
        } = o;
        let handed = hand_leases.then(|| (0..keys.len()).map(|_| None).collect());
        let pending = results
            .iter()
            .filter(|r| **r == KeyOutcome::Pending)
            .count();
        let now = Instant::now();
        let op = Arc::new(Self {
            id,
            ns,
            keys,
            conn,
            peer,
            actions,
            deadline: now + deadline,
            started: now,
            inner: Mutex::new(Inner {
                results,
                state: OpState::Pulling,
                reason: None,
                into,
                pending,
                ended: None,
                share: None,
                handed,
            }),
            done: watch::channel(false).0,
            changes: watch::channel(0).0,
        });
        if pending == 0 {
            op.with(|i| Self::finish(i, None));
            op.done.send_replace(true);
        }
        op
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().expect("op lock poisoned"))
    }

    fn finish(i: &mut Inner, state: Option<OpState>) {
        let lead = leading(&i.results) as usize;
        i.state = state.unwrap_or(if lead == i.results.len() {
            OpState::Done
        } else if lead > 0 {
            OpState::Partial
        } else {
            OpState::Failed
        });
        i.ended = Some(Instant::now());
        i.share = None;
    }

    /// Holds the op's tenant's share of the peer's in-flight cap until its keys are
    /// answered (given back at once if the op has already ended).
    pub fn hold(&self, share: Share) {
        let late = self.with(|i| {
            if i.state.is_terminal() {
                Some(share)
            } else {
                i.share = Some(share);
                None
            }
        });
        drop(late);
    }

    /// Records key `idx`'s outcome. Ignored once the op has ended (the block itself is
    /// already committed to the DRAM tier by the caller: nothing completed is lost).
    pub fn set(&self, idx: usize, outcome: KeyOutcome) {
        self.set_leased(idx, outcome, None);
    }

    /// Key `idx`'s outcome so far.
    pub fn outcome(&self, idx: usize) -> KeyOutcome {
        self.with(|i| i.results.get(idx).cloned().unwrap_or(KeyOutcome::Pending))
    }

    /// Whether the op keeps each pulled block's commit lease for its consumer.
    pub fn hands_leases(&self) -> bool {
        self.with(|i| i.handed.is_some())
    }

    /// [`PullOp::set`], keeping `lease` (the pulled block's, taken by its commit) for the
    /// consumer when the op hands leases; dropped (released) otherwise or once ended.
    pub fn set_leased(&self, idx: usize, outcome: KeyOutcome, lease: Option<Lease>) {
        let ended = self.with(|i| {
            if i.state.is_terminal() || i.results.get(idx) != Some(&KeyOutcome::Pending) {
                return None;
            }
            i.results[idx] = outcome;
            if let (Some(h), Some(l)) = (&mut i.handed, lease) {
                h[idx] = Some(l);
            }
            i.pending -= 1;
            if let Some(s) = &mut i.share {
                s.release(1);
            }
            if i.pending == 0 {
                Self::finish(i, None);
                return Some(true);
            }
            Some(false)
        });
        if let Some(ended) = ended {
            self.changes.send_modify(|n| *n += 1);
            if ended {
                self.done.send_replace(true);
            }
        }
    }

    /// The leading keys held here now (local hits and verified, committed pulls), and
    /// whether the op has ended.
    pub fn landed(&self) -> (usize, bool) {
        self.with(|i| (leading(&i.results) as usize, i.state.is_terminal()))
    }

    /// Takes the leases kept for keys `range` (`None` where none is kept: a local hit, a
    /// block committed by someone else first, or an op that does not hand leases).
    pub fn take_leases(&self, range: std::ops::Range<usize>) -> Vec<Option<Lease>> {
        self.with(|i| match &mut i.handed {
            Some(h) => h[range].iter_mut().map(Option::take).collect(),
            None => range.map(|_| None).collect(),
        })
    }

    /// Changes whenever a key's outcome is set or the op ends.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Copies `src` into key `idx`'s client buffer, if the op has one and is still live.
    /// Returns whether it wrote. This is the only writer of client buffers.
    pub fn copy_into(&self, idx: usize, src: &[u8]) -> Result<bool, Failure> {
        self.with(|i| {
            if i.state.is_terminal() {
                return Ok(false);
            }
            let Some((_, r)) = i.into.get_mut(idx) else {
                return Ok(false);
            };
            if src.len() as u64 != r.len() {
                return Err(Failure::new(
                    FailCode::LocalStore,
                    format!(
                        "peer block is {} bytes but the client buffer was allocated for {}",
                        src.len(),
                        r.len()
                    ),
                ));
            }
            // The op owns this reservation (taken from the client connection) and writes
            // it only here, under the op lock, before the op becomes terminal.
            r.bytes_mut().copy_from_slice(src);
            Ok(true)
        })
    }

    /// Whether this op fills client buffers.
    pub fn has_into(&self) -> bool {
        self.with(|i| !i.into.is_empty())
    }

    /// Ends the op as cancelled (or with the deadline's reason). Returns once no byte can be
    /// written into its buffers again: the state change happens under the copy lock.
    pub fn end(&self, state: OpState, reason: &Failure) {
        let changed = self.with(|i| {
            if i.state.is_terminal() {
                return false;
            }
            for r in &mut i.results {
                if *r == KeyOutcome::Pending {
                    *r = KeyOutcome::Failed(reason.clone());
                }
            }
            i.pending = 0;
            if state == OpState::Cancelled {
                i.reason = Some(reason.clone());
            }
            Self::finish(i, (state == OpState::Cancelled).then_some(state));
            true
        });
        if changed {
            self.changes.send_modify(|n| *n += 1);
            self.done.send_replace(true);
        }
    }

    /// Fails the whole op before any pull starts (bad hint, unauthorized peer, busy peer):
    /// the op's `reason` says why, once; each key still pending fails with the same code and
    /// no message of its own.
    pub fn refuse(&self, reason: &Failure) {
        self.with(|i| i.reason = Some(reason.clone()));
        self.end(OpState::Failed, &Failure::new(reason.code, ""));
    }

    /// Ends the op at its deadline; blocks still in flight keep landing in the DRAM tier.
    pub fn expire(&self) {
        self.end(
            OpState::Failed,
            &Failure::new(
                FailCode::Deadline,
                "deadline passed; the transfer continues into the DRAM tier",
            ),
        );
    }

    /// Waits until the op ends or `limit` passes.
    pub async fn wait(&self, limit: Duration) {
        let mut rx = self.done.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|d| *d)).await;
    }

    /// A snapshot.
    pub fn report(&self) -> OpReport {
        self.with(|i| OpReport {
            op: self.id,
            state: i.state,
            leading: leading(&i.results),
            results: i.results.clone(),
            peer: self.peer.clone(),
            reason: i.reason.clone(),
            elapsed_ms: self.started.elapsed().as_secs_f64() * 1e3,
            actions: self.actions.clone(),
        })
    }

    /// Hands the client buffers back once the op has ended (empty before).
    pub fn take_into(&self) -> Vec<(u64, Reservation)> {
        self.with(|i| {
            if i.state.is_terminal() {
                std::mem::take(&mut i.into)
            } else {
                Vec::new()
            }
        })
    }

    fn ended_before(&self, t: Instant) -> bool {
        self.with(|i| i.ended.is_some_and(|e| e < t))
    }
}

/// Live and recently ended operations, and each tenant's keys in flight per peer.
#[derive(Debug, Default)]
pub struct OpTable {
    ops: Mutex<Ops>,
    next: std::sync::atomic::AtomicU64,
    /// Keys in flight per peer and tenant (fair.rs).
    pub fair: Arc<FairShares>,
}

/// The table and when it was last swept for long-ended ops.
#[derive(Debug, Default)]
struct Ops {
    map: HashMap<u64, Arc<PullOp>>,
    /// Keys of the ops each connection has in the table (live or ended, not yet reported).
    keys_of_conn: HashMap<u64, usize>,
    swept: Option<Instant>,
    /// Size after the last sweep: the next sweep waits for the table to double (or a sweep
    /// interval to pass), so inserts cost O(1) amortized.
    kept: usize,
}

/// Ended ops nobody asked about are dropped after this long.
const KEEP_ENDED: Duration = Duration::from_mins(1);
/// The op table is swept for long-ended ops at least this often.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Keys one connection may have in the op table (each costs ~100 bytes of heap: its key,
/// its outcome); an op past it is refused `PeerBusy` after the connection's ended ops are
/// dropped. 256 Ki keys is more than any real prefix (at >= 4 KiB a block, 1 GiB).
pub const MAX_KEYS_PER_CONN: usize = 256 << 10;

impl Ops {
    fn forget(&mut self, id: u64) -> Option<Arc<PullOp>> {
        let op = self.map.remove(&id)?;
        if let Some(n) = self.keys_of_conn.get_mut(&op.conn) {
            *n -= op.keys.len();
            if *n == 0 {
                self.keys_of_conn.remove(&op.conn);
            }
        }
        Some(op)
    }

    /// Drops the ops that satisfy `gone` (never one still owning client buffers).
    fn drop_where(&mut self, gone: impl Fn(&PullOp) -> bool) {
        let ids: Vec<u64> = self
            .map
            .values()
            .filter(|o| gone(o) && !o.has_into())
            .map(|o| o.id)
            .collect();
        for id in ids {
            self.forget(id);
        }
    }
}

impl OpTable {
    /// A fresh op id.
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    /// Registers an op. Long-ended ops are dropped by a sweep that runs when the table has
    /// doubled since the last one or `SWEEP_EVERY` has passed: O(1) amortized per insert.
    /// Refused (`PeerBusy`) when the op's connection would hold more than
    /// [`MAX_KEYS_PER_CONN`] keys in the table even after its ended ops are dropped.
    pub fn insert(&self, op: Arc<PullOp>) -> Result<(), Failure> {
        let mut m = self.ops.lock().expect("op table lock");
        let now = Instant::now();
        let due = m.swept.is_none_or(|t| now.duration_since(t) >= SWEEP_EVERY)
            || m.map.len() >= 2 * m.kept.max(64);
        if due {
            if let Some(cutoff) = now.checked_sub(KEEP_ENDED) {
                m.drop_where(|o| o.ended_before(cutoff));
            }
            m.swept = Some(now);
            m.kept = m.map.len();
        }
        let held = |m: &Ops| m.keys_of_conn.get(&op.conn).copied().unwrap_or(0);
        if held(&m) + op.keys.len() > MAX_KEYS_PER_CONN {
            let conn = op.conn;
            m.drop_where(|o| o.conn == conn && o.ended_before(now));
        }
        let held = held(&m);
        if held + op.keys.len() > MAX_KEYS_PER_CONN {
            return Err(Failure::new(
                FailCode::PeerBusy,
                format!(
                    "this connection already has {held} keys in running or unreported ops (limit {MAX_KEYS_PER_CONN}): wait for or cancel them first"
                ),
            ));
        }
        *m.keys_of_conn.entry(op.conn).or_default() += op.keys.len();
        m.map.insert(op.id, op);
        Ok(())
    }

    /// Ops in the table (live and recently ended).
    pub fn len(&self) -> usize {
        self.ops.lock().expect("op table lock").map.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Looks an op up.
    pub fn get(&self, id: u64) -> Option<Arc<PullOp>> {
        self.ops
            .lock()
            .expect("op table lock")
            .map
            .get(&id)
            .cloned()
    }

    /// Forgets an op.
    pub fn remove(&self, id: u64) {
        self.ops.lock().expect("op table lock").forget(id);
    }

    /// Ops owned by a connection.
    pub fn of_conn(&self, conn: u64) -> Vec<Arc<PullOp>> {
        let m = self.ops.lock().expect("op table lock");
        m.map.values().filter(|o| o.conn == conn).cloned().collect()
    }
}
