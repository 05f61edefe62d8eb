//! Following a pull as it lands: the leading keys that are held here (local hits, verified
//! and committed pulls), run by run, as soon as each run has landed. Consumers that copy
//! pulled pages onward (a hinted GPU onload, a hinted `GetToRegion`) use it to start on the
//! first pages while later ones are still on the wire.

use std::ops::Range;
use std::sync::Arc;

use tokio::sync::watch;

use super::op::PullOp;

/// The runs of an op's leading keys, in prefix order, each reported once.
#[derive(Debug)]
pub struct Arrivals {
    op: Arc<PullOp>,
    changes: watch::Receiver<u64>,
    next: usize,
}

impl Arrivals {
    /// Follows `op` from its first key.
    pub fn new(op: Arc<PullOp>) -> Self {
        let changes = op.changes();
        Self {
            op,
            changes,
            next: 0,
        }
    }

    /// The op followed.
    pub fn op(&self) -> &Arc<PullOp> {
        &self.op
    }

    /// The next run of leading keys that has landed, waiting for it; `None` once the op has
    /// ended and every leading key was reported. The op's own deadline ends it (the deadline
    /// task of [`super::Peers::start`]), so this never waits past it.
    pub async fn next_run(&mut self) -> Option<Range<usize>> {
        loop {
            // Marked seen before reading, so a change after the read wakes the wait below.
            self.changes.borrow_and_update();
            let (lead, ended) = self.op.landed();
            if lead > self.next {
                let run = self.next..lead;
                self.next = lead;
                return Some(run);
            }
            if ended {
                return None;
            }
            if self.changes.changed().await.is_err() {
                // The op is gone with its sender: nothing more will land.
                return None;
            }
        }
    }
}
