//! `EventSink`: the cloneable, never-blocking handle the engine hands KV events to.

use std::sync::{Arc, Weak};

use tokio::sync::mpsc::{self, error::TrySendError};

use crate::account::{Account, QueueCharge, Refused};
use crate::error::SinkError;
use crate::snapshot::{Marker, SnapshotSource, SourceSlot};
use crate::stats::{Counters, Stats, bump};
use crate::validate::{ValidEvent, validate};
use crate::wire::{AllBlocksCleared, BlockRemoved, BlockStored, EventKind, KvEvent, Medium};

/// A validated event on its way to the publisher thread, with the bytes it is charged.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) event: ValidEvent,
    pub(crate) charge: QueueCharge,
}

/// What travels the queue: an event, or a snapshot's marker (see [`crate::snapshot`]).
#[derive(Debug)]
pub(crate) enum Item {
    Event(Queued),
    Mark(Marker),
}

/// Queues validated events for the publisher thread.
///
/// Thread-safe and cheap to clone; needs no async runtime. Every call returns at once:
/// the event is validated on the caller's thread, then queued or dropped (never waited
/// for). Events from all clones are published in the order their calls completed, so a
/// caller that submits parents before children keeps that order on the wire.
///
/// The queue is bounded in events (`queue_capacity`) and in bytes (`queue_bytes`, each
/// event's [`footprint`](ValidEvent::footprint)); a store submitted `_as` an
/// [`Account`] is also held to that account's share.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::Sender<Item>,
    counters: Arc<Counters>,
    queue_bytes: u64,
    source: Arc<SourceSlot>,
}

impl EventSink {
    pub(crate) fn new(
        tx: mpsc::Sender<Item>,
        counters: Arc<Counters>,
        queue_bytes: u64,
        source: Arc<SourceSlot>,
    ) -> Self {
        Self {
            tx,
            counters,
            queue_bytes,
            source,
        }
    }

    /// Serves residency snapshots from `source` (the replay socket's snapshot request and
    /// the answer to a replay request the ring can no longer cover). Weak: the source owns
    /// sinks, not the other way round. A later call replaces the source.
    pub fn serve_snapshots(&self, source: Weak<dyn SnapshotSource>) {
        self.source.set(source);
    }

    /// Queues a snapshot's marker behind every event queued so far. Never waits; returns
    /// the marker when the queue is full or closed (the caller may try again).
    pub fn mark(&self, marker: Marker) -> Result<(), Marker> {
        self.tx.try_send(Item::Mark(marker)).map_err(|e| match e {
            TrySendError::Full(Item::Mark(m)) | TrySendError::Closed(Item::Mark(m)) => m,
            _ => unreachable!("a marker was sent"),
        })
    }

    /// The seq of the first batch after every event queued so far, once the publisher has
    /// sent those: what a successor continues the stream at. `None` when the queue is
    /// full or closed.
    pub fn next_seq(&self) -> Option<tokio::sync::oneshot::Receiver<u64>> {
        let (marker, rx) = Marker::new();
        self.mark(marker).ok().map(|()| rx)
    }

    /// Announces blocks that became resident in `event.medium`.
    pub fn stored(&self, event: BlockStored) -> Result<(), SinkError> {
        self.submit_as(None, KvEvent::Stored(event))
    }

    /// Announces blocks that became resident, charged to `account`.
    pub fn stored_as(
        &self,
        account: Option<&Arc<Account>>,
        event: BlockStored,
    ) -> Result<(), SinkError> {
        self.submit_as(account, KvEvent::Stored(event))
    }

    /// Announces that `block_hashes` left `medium` (the medium their store used).
    pub fn removed(&self, medium: Medium, block_hashes: Vec<u64>) -> Result<(), SinkError> {
        self.removed_as(None, medium, block_hashes)
    }

    /// Announces a removal, charged to `account` (never refused for its share).
    pub fn removed_as(
        &self,
        account: Option<&Arc<Account>>,
        medium: Medium,
        block_hashes: Vec<u64>,
    ) -> Result<(), SinkError> {
        let event = KvEvent::Removed(BlockRemoved {
            block_hashes,
            medium,
        });
        self.submit_as(account, event)
    }

    /// Announces that every block of this publisher is gone.
    pub fn cleared(&self) -> Result<(), SinkError> {
        self.submit_as(None, KvEvent::Cleared(AllBlocksCleared))
    }

    /// Validates and queues any event, charged to nobody but the queue.
    pub fn submit(&self, event: KvEvent) -> Result<(), SinkError> {
        self.submit_as(None, event)
    }

    /// Validates and queues any event charged to `account`. A rejection, a full queue, a
    /// full account share (stores only) or a closed publisher is counted, logged the first
    /// time, and returned.
    pub fn submit_as(
        &self,
        account: Option<&Arc<Account>>,
        event: KvEvent,
    ) -> Result<(), SinkError> {
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
        let store = valid.event().kind() == EventKind::Stored;
        let bytes = valid.footprint();
        let charge =
            match QueueCharge::try_new(&self.counters, account, bytes, self.queue_bytes, store) {
                Ok(c) => c,
                Err(Refused::Global) => return Err(self.full()),
                Err(Refused::Account) => {
                    let account = account.expect("only an account refuses for its share");
                    account.count_drop();
                    if bump(&self.counters.dropped_account, 1) == 0 {
                        tracing::warn!(
                            account = account.name(),
                            "a tenant's share of the KV event queue is full: dropping its stores \
                         (logged once; see kvnode_events_dropped_total{{cause=\"tenant_budget\"}})"
                        );
                    }
                    return Err(SinkError::AccountFull);
                }
            };
        match self.tx.try_send(Item::Event(Queued {
            event: valid,
            charge,
        })) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(self.full()),
            Err(TrySendError::Closed(_)) => {
                bump(&self.counters.dropped_closed, 1);
                Err(SinkError::Closed)
            }
        }
    }

    fn full(&self) -> SinkError {
        if bump(&self.counters.dropped_full, 1) == 0 {
            tracing::warn!(
                capacity = self.tx.max_capacity(),
                bytes = self.queue_bytes,
                "KV event queue full: dropping events (logged once; see dropped_full)"
            );
        }
        SinkError::QueueFull
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

    fn sink(capacity: usize) -> (EventSink, mpsc::Receiver<Item>) {
        let (tx, rx) = mpsc::channel(capacity);
        (
            EventSink::new(tx, Arc::new(Counters::default()), u64::MAX, Arc::default()),
            rx,
        )
    }

    fn event(item: Item) -> ValidEvent {
        match item {
            Item::Event(q) => q.event,
            Item::Mark(_) => panic!("a marker"),
        }
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
            event(rx.try_recv().unwrap()).event(),
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
            .map(|q| match event(q).into_event() {
                KvEvent::Removed(r) => r.block_hashes[0],
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(order, [1, 2, 3]);
    }

    #[test]
    fn the_byte_bound_and_an_accounts_share_drop_stores_and_count() {
        let (tx, rx) = mpsc::channel(100);
        let sink = EventSink::new(tx, Arc::new(Counters::default()), 1600, Arc::default());
        let a = Account::new("a", 600);
        let store = |h| BlockStored::new(Medium::CpuPinned, 64).block(h, &[9; 64]);
        let one = ValidEvent::try_from(KvEvent::Stored(store(0)))
            .unwrap()
            .footprint();
        assert!(one > 400 && one < 600, "{one}");
        sink.stored_as(Some(&a), store(1)).unwrap();
        assert_eq!(
            sink.stored_as(Some(&a), store(2)),
            Err(SinkError::AccountFull)
        );
        // A removal is not held to the share; the global bound still holds.
        sink.removed_as(Some(&a), Medium::CpuPinned, vec![1])
            .unwrap();
        sink.stored(store(3)).unwrap();
        sink.stored(store(4)).unwrap();
        assert_eq!(sink.stored(store(5)), Err(SinkError::QueueFull));
        let s = sink.stats();
        assert_eq!((s.dropped_account, s.dropped_full), (1, 1));
        assert_eq!(a.stats().dropped, 1);
        assert!(s.queued_bytes <= 1600);
        drop(rx);
        assert_eq!(
            sink.stats().queued_bytes,
            0,
            "charges go back with the queue"
        );
        assert_eq!(a.stats().queued_bytes, 0);
    }
}
