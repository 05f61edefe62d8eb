//! Counters shared by the sinks and the publisher thread, and their plain snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::validate::RejectReason;
use crate::wire::EventKind;

/// Live counters. Relaxed atomics: each is monotone and read only for reporting.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) events: [AtomicU64; EventKind::ALL.len()],
    pub(crate) blocks: [AtomicU64; EventKind::ALL.len()],
    pub(crate) rejected: [AtomicU64; RejectReason::ALL.len()],
    pub(crate) dropped_full: AtomicU64,
    pub(crate) dropped_closed: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) next_seq: AtomicU64,
    pub(crate) encode_errors: AtomicU64,
    pub(crate) replay_requests: AtomicU64,
    pub(crate) replay_batches: AtomicU64,
    pub(crate) replay_bad_requests: AtomicU64,
    pub(crate) replay_send_errors: AtomicU64,
    pub(crate) dropped_account: AtomicU64,
    pub(crate) queued_bytes: AtomicU64,
    pub(crate) ring_bytes: AtomicU64,
    pub(crate) ring_batches: AtomicU64,
    pub(crate) ring_evicted: AtomicU64,
    pub(crate) snapshots: AtomicU64,
    pub(crate) snapshot_blocks: AtomicU64,
    pub(crate) snapshot_failures: AtomicU64,
}

/// Adds `n` and returns the previous value (so callers can log only the first time).
pub(crate) fn bump(counter: &AtomicU64, n: u64) -> u64 {
    counter.fetch_add(n, Ordering::Relaxed)
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

pub(crate) fn kind_index(kind: EventKind) -> usize {
    kind as usize
}

impl Counters {
    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            events: self.events.each_ref().map(load),
            blocks: self.blocks.each_ref().map(load),
            rejected: self.rejected.each_ref().map(load),
            dropped_full: load(&self.dropped_full),
            dropped_closed: load(&self.dropped_closed),
            batches: load(&self.batches),
            bytes: load(&self.bytes),
            next_seq: load(&self.next_seq),
            encode_errors: load(&self.encode_errors),
            replay_requests: load(&self.replay_requests),
            replay_batches: load(&self.replay_batches),
            replay_bad_requests: load(&self.replay_bad_requests),
            replay_send_errors: load(&self.replay_send_errors),
            dropped_account: load(&self.dropped_account),
            queued_bytes: load(&self.queued_bytes),
            ring_bytes: load(&self.ring_bytes),
            ring_batches: load(&self.ring_batches),
            ring_evicted: load(&self.ring_evicted),
            snapshots: load(&self.snapshots),
            snapshot_blocks: load(&self.snapshot_blocks),
            snapshot_failures: load(&self.snapshot_failures),
        }
    }
}

/// A point-in-time copy of the publisher's counters (all monotone except `next_seq`,
/// which only grows too). Metric names are suggestions for the daemon's registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    events: [u64; EventKind::ALL.len()],
    blocks: [u64; EventKind::ALL.len()],
    rejected: [u64; RejectReason::ALL.len()],
    /// Events refused because the queue to the publisher thread was at its event or byte
    /// bound (`kvnode_events_dropped_total{cause="queue_full"}`).
    pub dropped_full: u64,
    /// Stores refused because their account's (tenant's) share of the queue was full
    /// (`{cause="tenant_budget"}`).
    pub dropped_account: u64,
    /// Events submitted after the publisher shut down (`{cause="closed"}`).
    pub dropped_closed: u64,
    /// Batches published (`kvnode_events_batches_total`).
    pub batches: u64,
    /// Payload bytes published (`kvnode_events_bytes_total`).
    pub bytes: u64,
    /// Sequence number the next batch will carry; equals batches published so far.
    pub next_seq: u64,
    /// Batches that failed to encode (always 0 for validated events; counted, never hidden).
    pub encode_errors: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Batches sent in replay answers.
    pub replay_batches: u64,
    /// Replay requests ignored because their framing was wrong.
    pub replay_bad_requests: u64,
    /// Replay frames the socket refused to send (peer gone mid-answer).
    pub replay_send_errors: u64,
    /// Bytes of events (footprints) waiting for the publisher thread now
    /// (`kvnode_events_queued_bytes`).
    pub queued_bytes: u64,
    /// Payload bytes kept for replay now (`kvnode_events_replay_ring_bytes`); 0 without a
    /// replay endpoint (no ring is kept).
    pub ring_bytes: u64,
    /// Batches kept for replay now.
    pub ring_batches: u64,
    /// Batches evicted from the replay ring to keep it within its bounds.
    pub ring_evicted: u64,
    /// Residency snapshots sent (asked for, or filling a replay the ring could not cover).
    pub snapshots: u64,
    /// Blocks (one per medium) those snapshots carried.
    pub snapshot_blocks: u64,
    /// Snapshots that could not be taken (queue full for the marker, or the ring evicted
    /// the snapshot's seq before it was read, three times each); answered without one.
    pub snapshot_failures: u64,
}

impl Stats {
    /// Events of `kind` published in a batch (`kvnode_events_published_total{kind=...}`).
    pub fn events(&self, kind: EventKind) -> u64 {
        self.events[kind_index(kind)]
    }

    /// Blocks named by published events of `kind` (0 for clears).
    pub fn blocks(&self, kind: EventKind) -> u64 {
        self.blocks[kind_index(kind)]
    }

    /// Events of every kind published.
    pub fn events_total(&self) -> u64 {
        self.events.iter().sum()
    }

    /// Events refused for `reason` (`kvnode_events_rejected_total{reason=...}`).
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason.index()]
    }

    /// Events refused for any reason.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().sum()
    }

    /// Events lost before batching (queue full, tenant budget full or publisher closed).
    pub fn dropped_total(&self) -> u64 {
        self.dropped_full + self.dropped_account + self.dropped_closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_each_counter_into_its_own_slot() {
        let c = Counters::default();
        bump(&c.events[kind_index(EventKind::Removed)], 3);
        bump(&c.blocks[kind_index(EventKind::Removed)], 5);
        bump(&c.rejected[RejectReason::EmptySalt.index()], 2);
        bump(&c.dropped_full, 1);
        bump(&c.dropped_closed, 4);
        let s = c.snapshot();
        assert_eq!(s.events(EventKind::Removed), 3);
        assert_eq!(s.events(EventKind::Stored), 0);
        assert_eq!(s.blocks(EventKind::Removed), 5);
        assert_eq!(s.events_total(), 3);
        assert_eq!(s.rejected(RejectReason::EmptySalt), 2);
        assert_eq!(s.rejected_total(), 2);
        assert_eq!(s.dropped_total(), 5);
    }
}
