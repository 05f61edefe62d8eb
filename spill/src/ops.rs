//! Operations as they travel to an IO worker; each completes exactly once, even on shutdown.

use crate::buf::{Arena, Done, IoBuf};
use crate::completion::Completer;
use crate::error::SpillError;
use crate::format::RecordKind;
use crate::key::SpillKey;
use crate::stats::{Loc, Tracker};
use std::sync::Arc;

/// Result of a successful write.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteOutcome {
    /// Sequence number of this copy (a later write of the same key gets a higher one).
    pub seq: u64,
    /// Keys evicted to make room for this block; the engine publishes their removal.
    pub evicted: Vec<SpillKey>,
}

/// Result of a read: verified bytes, or why there are none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadOutcome {
    /// The first `len` bytes of the destination hold the block, checksum verified.
    Hit {
        /// Payload length.
        len: usize,
    },
    /// No bytes; the destination's contents are unspecified and must not be used.
    Miss(MissReason),
}

/// Why a read missed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissReason {
    /// The key is not in the tier.
    NotFound,
    /// The block was evicted (its region reclaimed) before or while it was read.
    Evicted,
    /// The bytes read failed their checksum or came back short (file changed or damaged);
    /// the key is dropped from the index.
    Corrupt,
    /// The device returned an error.
    Io,
}

/// An operation owning a buffer; completes with `Stopped` if dropped unfinished.
pub(crate) struct BufOp<R> {
    pub buf: Option<IoBuf>,
    done: Option<Completer<Done<R>>>,
    ticket: u64,
    tracker: Arc<Tracker>,
}

impl<R> BufOp<R> {
    pub fn new(buf: IoBuf, done: Completer<Done<R>>, tracker: Arc<Tracker>) -> Self {
        let ticket = tracker.begin();
        Self {
            buf: Some(buf),
            done: Some(done),
            ticket,
            tracker,
        }
    }

    pub fn finish(mut self, result: Result<R, SpillError>) {
        let (buf, done) = (self.buf.take(), self.done.take());
        // Leave the queue (drop ends the ticket) before the waiter wakes, so a caller that
        // saw its operation complete never sees it still counted in `queue_depth`.
        drop(self);
        if let (Some(buf), Some(done)) = (buf, done) {
            done.complete(Done { buf, result });
        }
    }

    pub fn buf_mut(&mut self) -> &mut IoBuf {
        self.buf.as_mut().expect("buffer present until finish")
    }
}

impl<R> Drop for BufOp<R> {
    fn drop(&mut self) {
        if let (Some(buf), Some(done)) = (self.buf.take(), self.done.take()) {
            done.complete(Done {
                buf,
                result: Err(SpillError::Stopped),
            });
        }
        self.tracker.end(self.ticket);
    }
}

/// An operation without a buffer (sync, arena registration).
pub(crate) struct UnitOp {
    done: Option<Completer<Result<(), SpillError>>>,
    ticket: u64,
    tracker: Arc<Tracker>,
}

impl UnitOp {
    pub fn new(done: Completer<Result<(), SpillError>>, tracker: Arc<Tracker>) -> Self {
        let ticket = tracker.begin();
        Self {
            done: Some(done),
            ticket,
            tracker,
        }
    }

    pub fn finish(mut self, result: Result<(), SpillError>) {
        let done = self.done.take();
        // As for `BufOp::finish`: out of the queue before the waiter wakes.
        drop(self);
        if let Some(done) = done {
            done.complete(result);
        }
    }
}

impl Drop for UnitOp {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done.complete(Err(SpillError::Stopped));
        }
        self.tracker.end(self.ticket);
    }
}

/// A delete or clear to persist as a marker record ([`crate::format::RecordKind`]). Marks
/// travel beside the messages, in a queue per worker that never refuses and never blocks the
/// caller, so that a delete made on an async task cannot stall it behind a full write queue
/// and is never dropped.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mark {
    pub kind: RecordKind,
    pub key: SpillKey,
}

/// A worker's queue of [`Mark`]s. The worker takes it before every message it handles, so a
/// mark queued before a write was sent is written before that write: a block written again
/// after its delete gets the higher sequence number and survives a restart.
pub(crate) type MarkQueue = crate::handoff::Handoff<Mark>;

/// A message to an IO worker.
pub(crate) enum Msg {
    /// Marks were queued: take them.
    Wake,
    Write {
        key: SpillKey,
        op: BufOp<WriteOutcome>,
    },
    Read {
        key: SpillKey,
        loc: Loc,
        op: BufOp<ReadOutcome>,
    },
    Sync(UnitOp),
    Arena {
        arena: Arena,
        op: UnitOp,
    },
}
