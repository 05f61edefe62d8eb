//! `EventSink`: the cloneable, never-blocking handle the engine hands KV events to.

use std::sync::Arc;

use tokio::sync::mpsc::{self, error::TrySendError};

use crate::error::SinkError;
use crate::stats::{Counters, Stats, bump};
use crate::validate::{ValidEvent, validate};
use crate::wire::{AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium};

/// Queues validated events for the publisher thread.
///
/// Thread-safe and cheap to clone; needs no async runtime. Every call returns at once:
/// the event is validated on the caller's thread, then queued or dropped (never waited
/// for). Events from all clones are published in the order their calls completed, so a
/// caller that submits parents before children keeps that order on the wire.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::Sender<ValidEvent>,
    counters: Arc<Counters>,
}

impl EventSink {
    pub(crate) fn new(tx: mpsc::Sender<ValidEvent>, counters: Arc<Counters>) -> Self {
        Self { tx, counters }
    }

    /// Announces blocks that became resident in `event.medium`.
    pub fn stored(&self, event: BlockStored) -> Result<(), SinkError> {
        self.submit(KvEvent::Stored(event))
    }

    /// Announces that `block_hashes` left `medium` (the medium their store used).
    pub fn removed(&self, medium: Medium, block_hashes: Vec<u64>) -> Result<(), SinkError> {
        self.submit(KvEvent::Removed(BlockRemoved {
            block_hashes,
            medium,
        }))
    }

    /// Announces that every block of this publisher is gone.
    pub fn cleared(&self) -> Result<(), SinkError> {
        self.submit(KvEvent::Cleared(AllBlocksCleared))
    }

    /// Validates and queues any event. A rejection, a full queue or a closed publisher is
    /// counted, logged the first time, and returned.
    pub fn submit(&self, event: KvEvent) -> Result<(), SinkError> {
        let valid = validate(event).map_err(|rejection| {
            let reason = rejection.reason();
            if bump(&self.counters.rejected[reason.index()], 1) == 0 {
                tracing::warn!(
                    reason = reason.label(),
                    %rejection,
                    "KV event rejected before batching (first of its kind; later ones are only counted)"
                );
            }
            SinkError::from(rejection)
        })?;
        match self.tx.try_send(valid) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                if bump(&self.counters.dropped_full, 1) == 0 {
                    tracing::warn!(
                        capacity = self.tx.max_capacity(),
                        "KV event queue full: dropping events (logged once; see dropped_full)"
                    );
                }
                Err(SinkError::QueueFull)
            }
            Err(TrySendError::Closed(_)) => {
                bump(&self.counters.dropped_closed, 1);
                Err(SinkError::Closed)
            }
        }
    }

    /// The publisher's counters now.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::RejectReason;

    fn sink(capacity: usize) -> (EventSink, mpsc::Receiver<ValidEvent>) {
        let (tx, rx) = mpsc::channel(capacity);
        (EventSink::new(tx, Arc::new(Counters::default())), rx)
    }

    #[test]
    fn rejected_events_never_reach_the_queue_and_are_counted() {
        let (sink, mut rx) = sink(8);
        let bad = BlockStored::new(Medium::CpuPinned, 4).block(1, &[1, 2, 3]);
        assert!(matches!(sink.stored(bad), Err(SinkError::Rejected(_))));
        assert!(matches!(
            sink.removed(Medium::Disk, vec![]),
            Err(SinkError::Rejected(_))
        ));
        assert!(rx.try_recv().is_err());
        let s = sink.stats();
        assert_eq!(s.rejected(RejectReason::TokenCountMismatch), 1);
        assert_eq!(s.rejected(RejectReason::EmptyBlockHashes), 1);
    }

    #[test]
    fn full_queue_drops_without_blocking_and_counts() {
        let (sink, mut rx) = sink(2);
        sink.cleared().unwrap();
        sink.removed(Medium::Disk, vec![1]).unwrap();
        assert_eq!(sink.cleared(), Err(SinkError::QueueFull));
        assert_eq!(sink.cleared(), Err(SinkError::QueueFull));
        assert_eq!(sink.stats().dropped_full, 2);
        assert_eq!(
            rx.try_recv().unwrap().event(),
            &KvEvent::Cleared(AllBlocksCleared)
        );
        rx.close();
        while rx.try_recv().is_ok() {}
        assert_eq!(sink.cleared(), Err(SinkError::Closed));
        assert_eq!(sink.stats().dropped_closed, 1);
    }

    #[test]
    fn clones_share_one_ordered_queue() {
        let (a, mut rx) = sink(8);
        let b = a.clone();
        a.removed(Medium::CpuPinned, vec![1]).unwrap();
        b.removed(Medium::CpuPinned, vec![2]).unwrap();
        a.removed(Medium::CpuPinned, vec![3]).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|e| match e.into_event() {
                KvEvent::Removed(r) => r.block_hashes[0],
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(order, [1, 2, 3]);
    }
}
