//! Sums of a request's blocks computed ahead of its send and overlapped with it: blocking
//! threads hash (and tag) the blocks with nothing remembered, in block order, while the
//! connection's task sends the ones already summed. A first pull of freshly offloaded
//! blocks, the usual router-steered pull, is otherwise hash, then send, then hash, one
//! block after the other on one thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvnode_proto::peer::PullKey;
use tokio::sync::mpsc;

use super::Batch;
use super::sums::{block_hash, remembered};
use crate::peer::hashes::Sums;
use crate::store::Lease;

/// Bytes to sum below which a request's blocks are summed in line by the send: about 150 µs
/// of BLAKE3 on one core, against the tens of µs a thread takes to wake.
pub(in crate::peer) const MIN_AHEAD: u64 = 1 << 20;

/// Where one block's sums are.
#[derive(Clone, Copy)]
enum State {
    /// Left to the send (or already taken).
    Send,
    /// With the threads.
    Queued,
    /// Back from them: [`block_hash`]'s answer.
    Got(Option<Sums>),
}

/// One block's sums as [`block_hash`] gave them (`None` inside: its bytes changed).
type Summed = (usize, Option<Sums>);

/// The sums being computed ahead for one request. Dropping it stops the threads after the
/// block each is on (an early return of the send); the leases they hold go with them.
pub(in crate::peer) struct SumsAhead {
    rx: Option<mpsc::UnboundedReceiver<Summed>>,
    /// Per block: where its sums are.
    state: Vec<State>,
    stop: Arc<AtomicBool>,
}

impl SumsAhead {
    /// Starts `threads` blocking threads on the leased blocks of `keys` that have no sums
    /// remembered, but for the first of them, which the send sums itself while the threads
    /// wake up; nothing when the rest hold less than [`MIN_AHEAD`] bytes (a hand-off costs
    /// more than summing them in line). Each thread takes the next block in order, so the
    /// first ones are ready first.
    pub(in crate::peer) fn start(
        batch: &Batch<'_>,
        leased: &[Option<Arc<Lease>>],
        threads: usize,
    ) -> Self {
        let Batch {
            peers: p,
            ns,
            keys,
            mac,
        } = *batch;
        let todo: VecDeque<(usize, Arc<Lease>)> = leased
            .iter()
            .enumerate()
            .filter_map(|(i, l)| Some((i, Arc::clone(l.as_ref()?))))
            .filter(|(i, b)| remembered(&p.hashes, ns, keys[*i], b, mac.map(|m| &**m)).is_none())
            .skip(1)
            .collect();
        let bytes: u64 = todo.iter().map(|(_, b)| b.len()).sum();
        let mut me = SumsAhead {
            rx: None,
            state: vec![State::Send; leased.len()],
            stop: Arc::new(AtomicBool::new(false)),
        };
        if threads == 0 || bytes < MIN_AHEAD {
            return me;
        }
        for (i, _) in &todo {
            me.state[*i] = State::Queued;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let spawn = threads.min(todo.len());
        let work = Arc::new(Mutex::new(todo));
        let keys: Arc<[PullKey]> = keys.into();
        for _ in 0..spawn {
            let (p, keys, work, mac) = (
                Arc::clone(p),
                Arc::clone(&keys),
                Arc::clone(&work),
                mac.cloned(),
            );
            let (tx, stop) = (tx.clone(), Arc::clone(&me.stop));
            tokio::task::spawn_blocking(move || {
                while !stop.load(Ordering::Relaxed) {
                    let next = work.lock().expect("sums work").pop_front();
                    let Some((i, b)) = next else { break };
                    let h = block_hash(&p.hashes, ns, keys[i], &b, mac.as_deref());
                    drop(b);
                    if tx.send((i, h)).is_err() {
                        break;
                    }
                }
            });
        }
        me.rx = Some(rx);
        me
    }

    /// Block `i`'s sums, waiting for the threads if they are still on it: `None` when it was
    /// not handed to them (remembered, not leased, nothing to spread) or they stopped before
    /// it; the send then computes them itself.
    pub(in crate::peer) async fn take(&mut self, i: usize) -> Option<Option<Sums>> {
        loop {
            match self.state.get(i)? {
                State::Send => return None,
                State::Got(h) => {
                    let h = *h;
                    self.state[i] = State::Send;
                    return Some(h);
                }
                State::Queued => {
                    let (j, h) = self.rx.as_mut()?.recv().await?;
                    self.state[j] = State::Got(h);
                }
            }
        }
    }
}

impl Drop for SumsAhead {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
