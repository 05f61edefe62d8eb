//! A pull op that one request owns from start to answer: it leaves the daemon's op table when
//! the request is done with it, on every path (answered, failed, dropped). Ops that outlive
//! their request (`Pull`, a hinted `Exists` still running) are owned by the connection instead
//! and leave the table when reported ended, cancelled, or when the connection closes.

use std::ops::Deref;
use std::sync::Arc;

use crate::peer::{Peers, PullOp};

/// An op in the table, owned by the request holding this guard.
#[derive(Debug)]
pub(super) struct ListedOp {
    peers: Arc<Peers>,
    op: Arc<PullOp>,
}

impl ListedOp {
    /// Takes ownership of `op`'s place in `peers`' op table.
    pub fn new(peers: Arc<Peers>, op: Arc<PullOp>) -> Self {
        Self { peers, op }
    }

    /// The op itself (it outlives the guard wherever a clone of it is kept).
    pub fn op(&self) -> &Arc<PullOp> {
        &self.op
    }
}

impl Deref for ListedOp {
    type Target = PullOp;

    fn deref(&self) -> &PullOp {
        &self.op
    }
}

impl Drop for ListedOp {
    fn drop(&mut self) {
        self.peers.ops.remove(self.op.id);
    }
}
