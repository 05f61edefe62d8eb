//! Replay: a bounded ring of recent batches and the ROUTER loop that re-sends them on request.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use crate::stats::{Counters, bump};

/// The sequence frame that closes a replay answer: -1 as an 8-byte big-endian i64.
pub const END_OF_REPLAY_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The most recent published batches, oldest first, with consecutive sequence numbers.
#[derive(Debug)]
pub(crate) struct Ring {
    capacity: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl Ring {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            batches: VecDeque::with_capacity(capacity.min(1024)),
        }
    }

    /// Appends the batch published as `seq` (always the previous seq + 1), evicting the oldest.
    pub(crate) fn push(&mut self, seq: u64, payload: Bytes) {
        debug_assert!(self.batches.back().is_none_or(|(last, _)| last + 1 == seq));
        if self.batches.len() == self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// Every kept batch with `seq >= start`, oldest first. Starts at the oldest kept batch
    /// when `start` was already evicted: the requester sees the gap from the first seq.
    pub(crate) fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let Some((first, _)) = self.batches.front() else {
            return Vec::new();
        };
        let skip = usize::try_from(start.saturating_sub(*first)).unwrap_or(usize::MAX);
        self.batches.iter().skip(skip).cloned().collect()
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
        let mut ring = Ring::new(capacity);
        for s in seqs {
            ring.push(s, Bytes::from(s.to_string()));
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
        assert!(Ring::new(4).since(0).is_empty());
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
