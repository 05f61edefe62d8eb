//! Replay: a bounded ring of recent batches and the ROUTER loop that re-sends them on request.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use crate::account::RingShare;
use crate::stats::{Counters, bump};

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
    counters: Arc<Counters>,
}

impl Ring {
    pub(crate) fn new(max_batches: usize, max_bytes: u64, counters: Arc<Counters>) -> Self {
        Self {
            max_batches,
            max_bytes,
            bytes: 0,
            batches: VecDeque::with_capacity(max_batches.min(1024)),
            counters,
        }
    }

    /// Appends the batch published as `seq` (always the previous seq + 1), then evicts
    /// the oldest batches until every bound holds.
    pub(crate) fn push(&mut self, seq: u64, payload: Bytes, shares: Vec<RingShare>) {
        debug_assert!(self.batches.back().is_none_or(|k| k.seq + 1 == seq));
        self.bytes += payload.len() as u64;
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

    /// Payload bytes kept.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A ring shared between the batcher (writer) and the replay loop (reader).
pub(crate) type SharedRing = Arc<Mutex<Ring>>;

/// A parsed replay request: who asked, whether it framed with an empty delimiter, and from where.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    peer: Bytes,
    delimited: bool,
    start_seq: u64,
}

/// Accepts `[identity, "", start_seq(8 BE)]` (DEALER, as Dynamo and `SGLang` send it) and
/// `[identity, start_seq(8 BE)]` (a DEALER without the delimiter; answered the same way).
fn parse_request(msg: &ZmqMessage) -> Option<Request> {
    let frames: Vec<&Bytes> = msg.iter().collect();
    let (peer, delimited, seq) = match frames.as_slice() {
        [peer, empty, seq] if empty.is_empty() => (*peer, true, *seq),
        [peer, seq] => (*peer, false, *seq),
        _ => return None,
    };
    let start_seq = u64::from_be_bytes(seq.as_ref().try_into().ok()?);
    Some(Request {
        peer: peer.clone(),
        delimited,
        start_seq,
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

/// Answers replay requests until `stop` flips: one `[seq, payload]` message per kept batch
/// from the requested seq on, then `[-1, ""]`.
pub(crate) async fn serve(
    mut socket: RouterSocket,
    ring: SharedRing,
    counters: Arc<Counters>,
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
            if bump(&counters.replay_bad_requests, 1) == 0 {
                tracing::warn!(
                    frames = msg.len(),
                    "ignoring malformed KV event replay request; expected [\"\", start_seq (8-byte BE)] (logged once)"
                );
            }
            continue;
        };
        bump(&counters.replay_requests, 1);
        let batches = ring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .since(req.start_seq);
        let mut sent = 0;
        let mut ok = true;
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            if socket.send(frame(&req, seq, payload)).await.is_err() {
                ok = false;
                break;
            }
            sent += 1;
        }
        let end = Bytes::from_static(&END_OF_REPLAY_SEQ);
        if !ok || socket.send(frame(&req, end, Bytes::new())).await.is_err() {
            bump(&counters.replay_send_errors, 1);
        }
        bump(&counters.replay_batches, sent);
        tracing::debug!(
            start_seq = req.start_seq,
            sent,
            "answered KV event replay request"
        );
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
        assert_eq!((req.delimited, req.start_seq), (true, 5));
        let without = ZmqMessage::try_from(vec![id.clone(), seq]).unwrap();
        assert!(!parse_request(&without).unwrap().delimited);
        let short = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), Bytes::from("1")]).unwrap();
        assert_eq!(parse_request(&short), None);
        let four = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), id.clone(), id]).unwrap();
        assert_eq!(parse_request(&four), None);
    }

    #[test]
    fn end_marker_is_minus_one() {
        assert_eq!(END_OF_REPLAY_SEQ, [0xFF; 8]);
        assert_eq!(i64::from_be_bytes(END_OF_REPLAY_SEQ), -1);
    }
}
