//! Joining pulls in flight: a key another op is pulling right now (a router's `kv.prefetch`,
//! another rank's hinted get) is not pulled a second time. The later op follows the earlier
//! op's outcome for that key and, once the block has landed, takes it from the DRAM tier like
//! a local hit (copied into its buffer, or its lease handed on) and reports it `Pulled`.
//!
//! ```text
//!  begin(op B) ─ lookup_local ─ KeysInFlight::find: key k pending in op A? ─┬─ no: pull it
//!                                                                           └─ yes: follow(A, k)
//!  follow: A's outcome for k ─ Pulled/HitLocal ─> lease from DRAM ─> B: Pulled
//!                            ─ Missed / Failed ─> B: the same (a failure says it was joined)
//! ```
//!
//! The index holds a weak reference per key pulled; entries of ended ops or answered keys are
//! swept whenever an op looks keys up, so it holds at most the keys in flight plus those
//! answered since the last lookup.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use kvnode_proto::Key;
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome};

use super::op::PullOp;
use crate::store::Store;

/// A key of one op that another op is pulling: (this op's index, the puller, its index).
pub type Joined = (usize, Arc<PullOp>, usize);

/// Who pulls a key now: the op and the key's index in it.
type Puller = (Weak<PullOp>, usize);

/// Keys being pulled, by (namespace handle, key).
type Pulling = HashMap<(u32, Key), Puller>;

/// The keys being pulled now, by namespace handle and key.
#[derive(Debug, Default)]
pub struct KeysInFlight {
    map: Mutex<Pulling>,
}

impl KeysInFlight {
    fn map(&self) -> std::sync::MutexGuard<'_, Pulling> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that `op` is pulling its keys `idx`.
    pub fn register(&self, op: &Arc<PullOp>, idx: &[usize]) {
        let mut m = self.map();
        for &i in idx {
            m.insert((op.ns, op.keys[i]), (Arc::downgrade(op), i));
        }
    }

    /// Of `pending` (indexes into `keys` of handle `ns`), those another live op is pulling
    /// now, with that op. Sweeps entries whose op ended or whose key was answered.
    pub fn find(&self, ns: u32, keys: &[Key], pending: &[usize]) -> Vec<Joined> {
        let mut m = self.map();
        m.retain(|_, (w, j)| {
            w.upgrade()
                .is_some_and(|o| o.outcome(*j) == KeyOutcome::Pending)
        });
        pending
            .iter()
            .filter_map(|&i| {
                let (w, j) = m.get(&(ns, keys[i]))?;
                Some((i, w.upgrade()?, *j))
            })
            .collect()
    }
}

/// Waits for `theirs`'s outcome of its key `j` (or for `ours` to end first).
async fn outcome_of(theirs: &PullOp, j: usize, ours: &PullOp) -> Option<KeyOutcome> {
    let (mut a, mut b) = (theirs.changes(), ours.changes());
    loop {
        if ours.landed().1 {
            return None;
        }
        // An op's end answers every key it left pending, so this settles once it ends.
        let o = theirs.outcome(j);
        if o != KeyOutcome::Pending {
            return Some(o);
        }
        tokio::select! {
            r = a.changed() => if r.is_err() { return Some(theirs.outcome(j)) },
            r = b.changed() => if r.is_err() { return None },
        }
    }
}

/// Takes a landed block for `op`'s key `i` from the DRAM tier as the op needs it.
async fn take_landed(store: &Arc<Store>, op: &PullOp, i: usize) {
    let leased = store.lease(op.ns, std::slice::from_ref(&op.keys[i])).await;
    let Some(lease) = leased.ok().and_then(|mut v| v.pop().flatten()) else {
        let why = "the block the joined pull landed left DRAM before this op could take it";
        op.set(
            i,
            KeyOutcome::Failed(Failure::new(FailCode::LocalStore, why)),
        );
        return;
    };
    if op.has_into() {
        match op.copy_into(i, lease.bytes()) {
            Ok(true) => op.set(i, KeyOutcome::Pulled),
            Ok(false) => {}
            Err(f) => op.set(i, KeyOutcome::Failed(f)),
        }
    } else if op.hands_leases() {
        op.set_leased(i, KeyOutcome::Pulled, Some(lease));
    } else {
        op.set(i, KeyOutcome::Pulled);
    }
}

/// Settles each joined key of `op` from the op pulling it.
pub async fn follow(store: Arc<Store>, op: Arc<PullOp>, joined: Vec<Joined>) {
    for (i, theirs, j) in joined {
        let Some(o) = outcome_of(&theirs, j, &op).await else {
            return;
        };
        match o {
            KeyOutcome::Pulled | KeyOutcome::HitLocal => take_landed(&store, &op, i).await,
            KeyOutcome::Missed => op.set(i, KeyOutcome::Missed),
            KeyOutcome::Failed(f) => {
                let msg = format!(
                    "the pull this key joined (op {}) failed: {}",
                    theirs.id, f.message
                );
                op.set(i, KeyOutcome::Failed(Failure::new(f.code, msg)));
            }
            KeyOutcome::Pending => {
                let why = format!(
                    "the pull this key joined (op {}) ended without it",
                    theirs.id
                );
                op.set(i, KeyOutcome::Failed(Failure::new(FailCode::Deadline, why)));
            }
        }
    }
}
