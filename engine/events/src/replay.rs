//! Replay: a bounded ring of recent batches and the ROUTER loop that re-sends them on request.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use crate::account::RingShare;
use crate::batch::EventBatch;
use crate::snapshot::{self, Entry, Marker, SourceSlot};
use crate::stats::{Counters, bump};
use crate::validate::ValidEvent;
use crate::wire::{AllBlocksCleared, KvEvent, now_ts};

/// The sequence frame that closes a replay answer: -1 as an 8-byte big-endian i64.
pub const END_OF_REPLAY_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// One kept batch: its seq, its payload, and the accounts its events are charged to.
#[derive(Debug)]
struct Kept {
    seq: u64,
    payload: Bytes,
    /// Given back (RAII) when the batch is evicted.
    shares: Vec<RingShare>,
}

/// The most recent published batches, oldest first, with consecutive sequence numbers.
///
/// Bounded three ways after every push: at most `max_batches` batches, at most
/// `max_bytes` payload bytes, and no account over its limit. The oldest batches go first,
/// so a batch larger than `max_bytes` (or an account's limit) is not kept at all.
#[derive(Debug)]
pub(crate) struct Ring {
    max_batches: usize,
    max_bytes: u64,
    bytes: u64,
    batches: VecDeque<Kept>,
    /// The seq after the newest batch pushed (kept or not).
    next: u64,
    counters: Arc<Counters>,
}

impl Ring {
    #[cfg(test)]
    pub(crate) fn new(max_batches: usize, max_bytes: u64, counters: Arc<Counters>) -> Self {
        Self::starting_at(0, max_batches, max_bytes, counters)
    }

    /// A ring whose first batch will be `seq` (a stream continued from a predecessor: a
    /// replay from below `seq` is not covered).
    pub(crate) fn starting_at(
        seq: u64,
        max_batches: usize,
        max_bytes: u64,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            max_batches,
            max_bytes,
            bytes: 0,
            batches: VecDeque::with_capacity(max_batches.min(1024)),
            next: seq,
            counters,
        }
    }

    /// Appends the batch published as `seq` (always the previous seq + 1), then evicts
    /// the oldest batches until every bound holds.
    pub(crate) fn push(&mut self, seq: u64, payload: Bytes, shares: Vec<RingShare>) {
        debug_assert!(self.batches.back().is_none_or(|k| k.seq + 1 == seq));
        self.bytes += payload.len() as u64;
        self.next = seq + 1;
        self.batches.push_back(Kept {
            seq,
            payload,
            shares,
        });
        let newest = self.batches.len() - 1;
        let mut evicted = 0;
        while self.batches.len() > self.max_batches
            || self.bytes > self.max_bytes
            || self.batches[newest - evicted]
                .shares
                .iter()
                .any(|s| s.account().ring_over_limit())
        {
            let Some(old) = self.batches.pop_front() else {
                break;
            };
            self.bytes -= old.payload.len() as u64;
            evicted += 1;
            if evicted > newest {
                break;
            }
        }
        bump(&self.counters.ring_evicted, evicted as u64);
        self.counters.ring_bytes.store(self.bytes, Relaxed);
        self.counters
            .ring_batches
            .store(self.batches.len() as u64, Relaxed);
    }

    /// Every kept batch with `seq >= start`, oldest first. Starts at the oldest kept batch
    /// when `start` was already evicted: the requester sees the gap from the first seq.
    pub(crate) fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let Some(first) = self.batches.front() else {
            return Vec::new();
        };
        let skip = usize::try_from(start.saturating_sub(first.seq)).unwrap_or(usize::MAX);
        self.batches
            .iter()
            .skip(skip)
            .map(|k| (k.seq, k.payload.clone()))
            .collect()
    }

    /// Whether every batch from `start` on is still kept (a `start` past the newest
    /// batch is covered: there is nothing to miss).
    pub(crate) fn covers(&self, start: u64) -> bool {
        match self.batches.front() {
            Some(first) => start >= first.seq,
            None => start >= self.next,
        }
    }

    /// Payload bytes kept.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A ring shared between the batcher (writer) and the replay loop (reader).
pub(crate) type SharedRing = Arc<Mutex<Ring>>;

/// The request frame that asks for a residency snapshot instead of a replay. Not 8 bytes
/// long, so it can never be mistaken for a `start_seq`.
pub const SNAPSHOT_REQUEST: &[u8] = b"kvnode:snapshot";

/// The sequence frame of the batches of an explicitly requested snapshot: -2 as an 8-byte
/// big-endian i64 (no batch ever carries it).
pub const SNAPSHOT_SEQ: [u8; 8] = (-2i64).to_be_bytes();

/// How often a snapshot is retaken when the ring evicted its seq before it could be read.
const SNAPSHOT_TRIES: usize = 3;

/// After a copy that held the engine's epoch lock for `t`, the next copy waits `9 t`.
const PACE_FACTOR: u32 = 9;

/// What a request asks for.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Ask {
    /// Every kept batch from this seq on.
    Replay(u64),
    /// The whole residency, consistent with a seq (see `docs/events.md`).
    Snapshot,
}

/// A parsed request: who asked, whether it framed with an empty delimiter, and what for.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    peer: Bytes,
    delimited: bool,
    ask: Ask,
}

/// Accepts `[identity, "", body]` (DEALER, as Dynamo and `SGLang` send it) and
/// `[identity, body]` (a DEALER without the delimiter; answered the same way), where body
/// is `start_seq` (8 bytes BE) or [`SNAPSHOT_REQUEST`].
fn parse_request(msg: &ZmqMessage) -> Option<Request> {
    let frames: Vec<&Bytes> = msg.iter().collect();
    let (peer, delimited, body) = match frames.as_slice() {
        [peer, empty, body] if empty.is_empty() => (*peer, true, *body),
        [peer, body] => (*peer, false, *body),
        _ => return None,
    };
    let ask = if body.as_ref() == SNAPSHOT_REQUEST {
        Ask::Snapshot
    } else {
        Ask::Replay(u64::from_be_bytes(body.as_ref().try_into().ok()?))
    };
    Some(Request {
        peer: peer.clone(),
        delimited,
        ask,
    })
}

fn frame(req: &Request, seq: Bytes, payload: Bytes) -> ZmqMessage {
    let mut frames = Vec::with_capacity(4);
    frames.push(req.peer.clone());
    if req.delimited {
        frames.push(Bytes::new());
    }
    frames.push(seq);
    frames.push(payload);
    ZmqMessage::try_from(frames).expect("replay frames are never empty")
}

/// A snapshot as sent: taken consistent with `seq` (the first batch it does not cover),
/// its blocks parents first, and the ring's batches from `seq` on (read right after).
struct Taken {
    seq: u64,
    entries: Vec<Entry>,
    tail: Vec<(u64, Bytes)>,
}

/// Answers replay and snapshot requests: what the replay loop needs besides its socket.
pub(crate) struct Answerer {
    pub(crate) ring: SharedRing,
    pub(crate) source: Arc<SourceSlot>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) dp_rank: Option<u32>,
    /// Events per snapshot batch (the publisher's `max_batch_events`).
    pub(crate) batch_events: usize,
    /// The earliest time the next snapshot may copy (see [`PACE_FACTOR`]).
    pub(crate) pace: Mutex<Option<Instant>>,
}

impl Answerer {
    fn lock_ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies the residency (off this thread: the copy waits for the engine's epoch lock)
    /// and learns its seq from the marker; `None` without a source or when the marker
    /// never got into the queue.
    async fn take(&self) -> Option<(u64, Vec<Entry>)> {
        let source = self.source.get()?;
        for _ in 0..SNAPSHOT_TRIES {
            let next = *self.pace.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = next {
                tokio::time::sleep_until(at).await;
            }
            let (marker, seq) = Marker::new();
            let src = Arc::clone(&source);
            let (copied, held) = tokio::task::spawn_blocking(move || {
                let t0 = std::time::Instant::now();
                let copied = src.snapshot(marker);
                let held = t0.elapsed();
                (copied.map(snapshot::parents_first), held)
            })
            .await
            .ok()?;
            // The copy stalled the engine's stores and removals for `held` (at most): the
            // next copy waits 9 times that, so a flood of requests stalls them at most 10%
            // of the time.
            *self.pace.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Instant::now() + held * PACE_FACTOR);
            match copied {
                Ok(entries) => return Some((seq.await.ok()?, entries)),
                // The queue is full: let the publisher drain it.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        None
    }

    /// A snapshot whose seq the ring still holds (retaken if the ring evicted it first).
    async fn take_with_tail(&self) -> Option<Taken> {
        for _ in 0..SNAPSHOT_TRIES {
            let (seq, entries) = self.take().await?;
            let ring = self.lock_ring();
            if ring.covers(seq) {
                let tail = ring.since(seq);
                return Some(Taken { seq, entries, tail });
            }
        }
        None
    }

    /// Sends `entries` as batches of `AllBlocksCleared` then one store per (medium,
    /// block), each under the sequence frame `seq`. Encodes one batch at a time. Returns
    /// the messages sent, or `None` when the socket refused one.
    async fn send_residency(
        &self,
        socket: &mut RouterSocket,
        req: &Request,
        seq: [u8; 8],
        entries: &[Entry],
    ) -> Option<u64> {
        let mut events = vec![ValidEvent::try_from(KvEvent::Cleared(AllBlocksCleared)).ok()?];
        let mut sent = 0;
        let mut rest = entries.iter().peekable();
        loop {
            while events.len() < self.batch_events.max(1) {
                let Some((medium, block)) = rest.next() else {
                    break;
                };
                // Valid when it was published; a refusal here would only be counted.
                if let Ok(ev) = ValidEvent::try_from(KvEvent::Stored(block.stored(*medium))) {
                    events.push(ev);
                }
            }
            let batch = EventBatch {
                ts: now_ts(),
                events: &events,
                dp_rank: self.dp_rank,
            };
            let payload = Bytes::from(batch.encode().ok()?);
            let msg = frame(req, Bytes::copy_from_slice(&seq), payload);
            socket.send(msg).await.ok()?;
            sent += 1;
            events.clear();
            if rest.peek().is_none() {
                return Some(sent);
            }
        }
    }

    /// Sends kept batches as `[seq, payload]`; `None` when the socket refused one.
    async fn send_batches(
        socket: &mut RouterSocket,
        req: &Request,
        batches: Vec<(u64, Bytes)>,
    ) -> Option<u64> {
        let mut sent = 0;
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            socket.send(frame(req, seq, payload)).await.ok()?;
            sent += 1;
        }
        Some(sent)
    }

    /// `[-1, end]`: `end` is empty after a replay, the snapshot's seq after a snapshot.
    async fn send_end(socket: &mut RouterSocket, req: &Request, end: Bytes) -> Option<()> {
        let seq = Bytes::from_static(&END_OF_REPLAY_SEQ);
        socket.send(frame(req, seq, end)).await.ok()
    }

    /// A replay from `start`. When the ring no longer holds `start` and a source is
    /// registered, the hole is filled with a snapshot (`AllBlocksCleared` and the stores
    /// of the residency, all under seq `S - 1`) followed by the ring from `S`: what a
    /// subscriber that does not know snapshots (Dynamo) applies as an ordinary replay.
    async fn replay(&self, socket: &mut RouterSocket, req: &Request, start: u64) {
        let covered = self.lock_ring().covers(start);
        let mut sent = Some(0);
        let mut tail = None;
        if !covered && self.source.get().is_some() {
            match self.take_with_tail().await {
                Some(t) => {
                    let seq = t.seq.saturating_sub(1).to_be_bytes();
                    sent = self.send_residency(socket, req, seq, &t.entries).await;
                    self.count_snapshot(t.entries.len());
                    tail = Some(t.tail);
                }
                None => self.count_snapshot_failure(),
            }
        }
        let tail = tail.unwrap_or_else(|| self.lock_ring().since(start));
        if let Some(n) = sent {
            sent = Self::send_batches(socket, req, tail).await.map(|m| n + m);
        }
        let ok = sent.is_some() && Self::send_end(socket, req, Bytes::new()).await.is_some();
        if !ok {
            bump(&self.counters.replay_send_errors, 1);
        }
        bump(&self.counters.replay_batches, sent.unwrap_or(0));
        tracing::debug!(start, covered, ?sent, "answered KV event replay request");
    }

    /// An explicit snapshot: its batches under [`SNAPSHOT_SEQ`], then `[-1, S (8 BE)]`.
    /// Without a source (or when no snapshot could be taken) only `[-1, ""]`.
    async fn snapshot(&self, socket: &mut RouterSocket, req: &Request) {
        let mut end = Bytes::new();
        let mut sent = Some(0);
        match self.take().await {
            Some((seq, entries)) => {
                sent = self
                    .send_residency(socket, req, SNAPSHOT_SEQ, &entries)
                    .await;
                self.count_snapshot(entries.len());
                end = Bytes::copy_from_slice(&seq.to_be_bytes());
            }
            None if self.source.get().is_some() => self.count_snapshot_failure(),
            None => {}
        }
        if sent.is_none() || Self::send_end(socket, req, end).await.is_none() {
            bump(&self.counters.replay_send_errors, 1);
        }
    }

    fn count_snapshot(&self, blocks: usize) {
        bump(&self.counters.snapshots, 1);
        bump(&self.counters.snapshot_blocks, blocks as u64);
    }

    fn count_snapshot_failure(&self) {
        if bump(&self.counters.snapshot_failures, 1) == 0 {
            tracing::warn!(
                "could not take a residency snapshot (queue full, or the ring evicted its seq \
                 before it was read); answered without it (logged once)"
            );
        }
    }
}

/// Answers requests until `stop` flips, one at a time: a replay (`[seq, payload]` per kept
/// batch from the requested seq on, then `[-1, ""]`) or a snapshot.
pub(crate) async fn serve(
    mut socket: RouterSocket,
    answer: Answerer,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let received = tokio::select! {
            _ = stop.changed() => return,
            received = socket.recv() => received,
        };
        let msg = match received {
            Ok(msg) => msg,
            Err(error) => {
                tracing::debug!(%error, "replay socket receive failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(req) = parse_request(&msg) else {
            if bump(&answer.counters.replay_bad_requests, 1) == 0 {
                tracing::warn!(
                    frames = msg.len(),
                    "ignoring malformed KV event replay request; expected [\"\", start_seq (8-byte BE)] or [\"\", \"kvnode:snapshot\"] (logged once)"
                );
            }
            continue;
        };
        bump(&answer.counters.replay_requests, 1);
        match req.ask {
            Ask::Replay(start) => answer.replay(&mut socket, &req, start).await,
            Ask::Snapshot => answer.snapshot(&mut socket, &req).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_of(capacity: usize, seqs: std::ops::Range<u64>) -> Ring {
        let mut ring = Ring::new(capacity, u64::MAX, Arc::default());
        for s in seqs {
            ring.push(s, Bytes::from(s.to_string()), Vec::new());
        }
        ring
    }

    #[test]
    fn ring_keeps_only_the_newest_batches() {
        let ring = ring_of(3, 0..10);
        let seqs: Vec<u64> = ring.since(0).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, [7, 8, 9]);
    }

    #[test]
    fn ring_answers_from_the_requested_seq() {
        let ring = ring_of(100, 0..10);
        let got = ring.since(6);
        assert_eq!(
            got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [6, 7, 8, 9]
        );
        assert_eq!(got[0].1, Bytes::from("6"));
        assert!(ring.since(10).is_empty());
        assert!(ring.since(u64::MAX).is_empty());
        assert!(Ring::new(4, 1, Arc::default()).since(0).is_empty());
    }

    #[test]
    fn ring_stays_within_its_byte_bound_and_drops_a_batch_larger_than_it() {
        let counters = Arc::new(Counters::default());
        let mut ring = Ring::new(100, 10, Arc::clone(&counters));
        for s in 0..5 {
            ring.push(s, Bytes::from_static(b"abcd"), Vec::new());
            assert!(ring.bytes() <= 10);
        }
        assert_eq!(ring.since(0).len(), 2);
        ring.push(5, Bytes::from(vec![0u8; 11]), Vec::new());
        assert!(ring.since(0).is_empty() && ring.bytes() == 0);
        assert_eq!(counters.ring_evicted.load(Relaxed), 6);
        ring.push(6, Bytes::from_static(b"ab"), Vec::new());
        assert_eq!(ring.since(0)[0].0, 6);
    }

    #[test]
    fn an_account_over_its_share_evicts_oldest_first_and_gets_its_bytes_back() {
        use crate::account::{Account, ring_shares};
        let a = Account::new("a", 100);
        let b = Account::new("b", 1000);
        let mut ring = Ring::new(100, u64::MAX, Arc::default());
        ring.push(
            0,
            Bytes::from_static(b"b"),
            ring_shares([(&b, 50)].into_iter()),
        );
        for s in 1..4 {
            ring.push(
                s,
                Bytes::from_static(b"a"),
                ring_shares([(&a, 40)].into_iter()),
            );
        }
        // a's third batch put it at 120 > 100: the oldest batches (b's, then a's first) went.
        let seqs: Vec<u64> = ring.since(0).iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [2, 3]);
        assert_eq!((a.stats().ring_bytes, b.stats().ring_bytes), (80, 0));
        drop(ring);
        assert_eq!(a.stats().ring_bytes, 0);
    }

    #[test]
    fn requests_parse_with_and_without_delimiter() {
        let id = Bytes::from_static(b"peer");
        let seq = Bytes::copy_from_slice(&5u64.to_be_bytes());
        let with = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), seq.clone()]).unwrap();
        let req = parse_request(&with).unwrap();
        assert_eq!((req.delimited, req.ask), (true, Ask::Replay(5)));
        let without = ZmqMessage::try_from(vec![id.clone(), seq]).unwrap();
        assert!(!parse_request(&without).unwrap().delimited);
        let short = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), Bytes::from("1")]).unwrap();
        assert_eq!(parse_request(&short), None);
        let four =
            ZmqMessage::try_from(vec![id.clone(), Bytes::new(), id.clone(), id.clone()]).unwrap();
        assert_eq!(parse_request(&four), None);
        let snap = Bytes::from_static(SNAPSHOT_REQUEST);
        let ask = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), snap.clone()]).unwrap();
        assert_eq!(parse_request(&ask).unwrap().ask, Ask::Snapshot);
        let bare = ZmqMessage::try_from(vec![id.clone(), snap]).unwrap();
        assert_eq!(parse_request(&bare).unwrap().ask, Ask::Snapshot);
        let near =
            ZmqMessage::try_from(vec![id, Bytes::new(), Bytes::from("kvnode:snapshoT")]).unwrap();
        assert_eq!(parse_request(&near), None);
    }

    #[test]
    fn the_ring_covers_only_what_it_still_keeps() {
        let ring = ring_of(3, 0..10);
        assert!(!ring.covers(6) && ring.covers(7) && ring.covers(10) && ring.covers(99));
        let mut empty = Ring::new(4, 1, Arc::default());
        assert!(empty.covers(0));
        empty.push(0, Bytes::from_static(b"too big"), Vec::new());
        assert!(!empty.covers(0) && empty.covers(1));
        assert_ne!(SNAPSHOT_REQUEST.len(), 8);
    }

    #[test]
    fn end_marker_is_minus_one() {
        assert_eq!(END_OF_REPLAY_SEQ, [0xFF; 8]);
        assert_eq!(i64::from_be_bytes(END_OF_REPLAY_SEQ), -1);
    }
}
