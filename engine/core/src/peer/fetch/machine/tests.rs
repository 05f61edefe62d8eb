//! The pull's rules pinned in memory, deterministically: a [`PullMachine`] and a real
//! [`PullOp`] (its client buffers reserved in a small in-memory store) driven frame by frame
//! as the driver drives them (quinn-proto's `Pair`), with time as plain `Instant` values: no
//! socket, no thread, no sleep, no clock read by the code under test.
//! Run: `cargo test --release -p kvnode-engine --lib peer::fetch::machine`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_proto::peer::{HASH_LEN, PeerMsg, PullKey};
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome, OpState};
use kvnode_proto::{Digest, Key, NamespaceId, NamespaceSpec};

use super::{Answer, Body, Check, Checked, PullMachine, Step, Verdict};
use crate::peer::PeerError;
use crate::peer::error::{PullError, Stage, Violation};
use crate::peer::op::{NewOp, PullOp};
use crate::store::Store;

const PAGE: usize = 4096;
const NS: NamespaceId = NamespaceId(0x7777);

fn key(i: usize) -> Key {
    let mut d = [0u8; 32];
    d[0] = i as u8;
    d[31] = 0x5a;
    Key::page(Digest(d))
}

fn bytes(i: usize) -> Vec<u8> {
    (0..PAGE)
        .map(|j| (j as u8).wrapping_mul(13) ^ i as u8)
        .collect()
}

fn hash_of(i: usize) -> [u8; HASH_LEN] {
    *blake3::hash(&bytes(i)).as_bytes()
}

/// A destination's view of one chunk: the machine, the op it pulls for (with a client
/// buffer per key), and the keys whose bytes the driver would have committed to its store.
struct Pull {
    m: PullMachine<()>,
    op: Arc<PullOp>,
    /// Keeps the client buffers' arena alive.
    _store: Arc<Store>,
    /// Keys whose bytes were committed (to the DRAM tier), in order.
    committed: Vec<usize>,
    /// The `Pull` frames the machine asked to send.
    sent: Vec<PeerMsg>,
}

impl Pull {
    /// `n` keys pulled in requests of `batch`, ids from 1; `deadline`: an in-place pull's.
    fn new(n: usize, batch: usize, deadline: Option<Instant>) -> Self {
        let store = crate::peer::tests::small_store();
        let spec = NamespaceSpec {
            model: "pull-machine".into(),
            page_size: 64,
            segments: vec![PAGE as u64],
            ..NamespaceSpec::default()
        };
        let ns = store.register(&spec).expect("namespace").ns;
        let keys: Vec<Key> = (0..n).map(key).collect();
        // Client buffers: reservations under other keys, as an `Alloc` makes them.
        let bufs: Vec<Key> = (100..100 + n).map(key).collect();
        let into = store
            .reserve(9, ns, &bufs, &vec![PAGE as u64; n])
            .expect("reserve")
            .into_iter()
            .enumerate()
            .map(|(h, r)| (h as u64, r.expect("client buffer")))
            .collect();
        let op = PullOp::new(NewOp {
            id: 1,
            ns,
            keys: keys.clone(),
            conn: 1,
            peer: Some("tcp://source:1".into()),
            results: vec![KeyOutcome::Pending; n],
            into,
            deadline: Duration::from_mins(1),
            hand_leases: false,
            actions: Vec::new(),
        });
        let mut m = PullMachine::new((0..n).collect(), deadline);
        let mut next = 0;
        let sent = m.requests(NS, &keys, batch, || {
            next += 1;
            next
        });
        Self {
            m,
            op,
            _store: store,
            committed: Vec::new(),
            sent,
        }
    }

    /// Feeds one frame and carries out its step as the driver does, the bytes of key `i`
    /// being [`bytes`]`(i)`.
    fn feed(&mut self, msg: PeerMsg) -> Result<Step, PeerError> {
        let step = self.m.handle_frame(msg)?;
        match &step {
            Step::Nothing => {}
            Step::Body(a) => {
                if let Body::Inline { .. } = a.body {
                    let got = Checked::Hashed(hash_of(a.i));
                    let v = self.m.body_in(a.i, &a.hash, got)?;
                    self.settle(a.i, v);
                }
            }
            Step::Outcome { key, outcome } => self.op.set(*key, outcome.clone()),
            Step::Done(req) => self.m.close(*req)?,
        }
        Ok(step)
    }

    /// Feeds request 1's `Slot` for key 0 and starts its GET, as the driver does.
    fn get_of_first_slot(&mut self) -> Answer {
        let Step::Body(a) = self.feed(slot(1, 0, 0)).unwrap() else {
            panic!("a Slot is a body to GET");
        };
        self.m.get_started(a.i, a.req, ());
        a
    }

    /// The driver's `settle`, with the store commit recorded instead of made.
    fn settle(&mut self, i: usize, v: Verdict) {
        match v {
            Verdict::Mismatch(check) => self.op.set(i, KeyOutcome::Failed(check.failure(4, "p"))),
            Verdict::Commit { .. } => {
                let copied = self.op.copy_into(i, &bytes(i));
                self.committed.push(i);
                match copied {
                    Err(why) => self.op.set(i, KeyOutcome::Failed(why)),
                    Ok(_) => self.op.set(i, KeyOutcome::Pulled),
                }
            }
        }
    }

    /// The driver's end of a failed chunk: every open key fails with `e`'s reason.
    fn fail(&self, e: &PeerError) {
        let why = e.failure();
        for &i in self.m.open() {
            self.op.set(i, KeyOutcome::Failed(why.clone()));
        }
    }

    fn results(&self) -> Vec<KeyOutcome> {
        self.op.report().results
    }

    /// Bytes of each client buffer (after the op ended).
    fn buffers(&self) -> Vec<Vec<u8>> {
        let mut into = self.op.take_into();
        into.iter_mut()
            .map(|(_, r)| r.bytes_mut().to_vec())
            .collect()
    }
}

fn block(req: u64, idx: u32, i: usize) -> PeerMsg {
    PeerMsg::Block {
        req,
        idx,
        len: PAGE as u32,
        hash: hash_of(i).to_vec(),
        seal: Vec::new(),
        meta: None,
    }
}

fn slot(req: u64, idx: u32, i: usize) -> PeerMsg {
    PeerMsg::Slot {
        req,
        idx,
        len: PAGE as u32,
        addr: 0x1000 * (i as u64 + 1),
        hash: hash_of(i).to_vec(),
        seal: Vec::new(),
        meta: None,
    }
}

fn violation(r: Result<Step, PeerError>) -> Violation {
    match r {
        Err(PeerError::Pull(PullError::Violation(v))) => v,
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

#[test]
fn requests_cover_the_keys_in_batches_and_answers_in_prefix_order_deliver_every_key() {
    let mut p = Pull::new(5, 2, None);
    let asked: Vec<(u64, Vec<PullKey>)> = p
        .sent
        .iter()
        .map(|m| match m {
            PeerMsg::Pull { req, ns, keys, .. } => {
                assert_eq!(*ns, NS);
                (*req, keys.clone())
            }
            other => panic!("not a Pull: {other:?}"),
        })
        .collect();
    let want = |r: std::ops::Range<usize>| r.map(|i| PullKey(key(i).0, key(i).1)).collect();
    assert_eq!(
        asked,
        vec![(1, want(0..2)), (2, want(2..4)), (3, want(4..5))]
    );
    for (req, first, n) in [(1, 0, 2), (2, 2, 2), (3, 4, 1)] {
        for idx in 0..n {
            let i = first + idx;
            let step = p.feed(block(req, idx as u32, i)).unwrap();
            assert!(matches!(step, Step::Body(Answer { i: k, .. }) if k == i));
        }
        assert!(!p.m.is_done());
        assert_eq!(p.feed(PeerMsg::Done { req }).unwrap(), Step::Done(req));
    }
    assert!(p.m.is_done() && p.m.open().is_empty());
    assert_eq!(p.committed, vec![0, 1, 2, 3, 4]);
    let r = p.op.report();
    assert_eq!((r.state, r.leading), (OpState::Done, 5));
    let bufs = p.buffers();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(*b, bytes(i), "client buffer {i}");
    }
}

#[test]
fn an_answer_naming_no_open_request_key_is_a_violation_and_commits_nothing() {
    let mut p = Pull::new(3, 2, None);
    // A request never sent, and an index past its request's keys.
    assert!(matches!(
        violation(p.feed(block(9, 0, 0))),
        Violation::UnknownKey { req: 9, idx: 0 }
    ));
    assert!(matches!(
        violation(p.feed(block(2, 1, 2))),
        Violation::UnknownKey { req: 2, idx: 1 }
    ));
    assert!(matches!(
        violation(p.feed(PeerMsg::Miss { req: 1, idx: 5 })),
        Violation::UnknownKey { req: 1, idx: 5 }
    ));
    // Out of protocol order: an answer after its request's Done, and a second Done.
    p.feed(block(2, 0, 2)).unwrap();
    p.feed(PeerMsg::Done { req: 2 }).unwrap();
    assert!(matches!(
        violation(p.feed(block(2, 0, 2))),
        Violation::UnknownKey { req: 2, idx: 0 }
    ));
    assert!(matches!(
        violation(p.feed(PeerMsg::Done { req: 2 })),
        Violation::UnknownRequest { req: 2 }
    ));
    assert_eq!(p.committed, vec![2]);
    assert_eq!(p.m.open().len(), 2);
}

#[test]
fn a_key_answered_twice_is_a_violation_whatever_the_second_answer() {
    let mut p = Pull::new(2, 2, None);
    p.feed(block(1, 0, 0)).unwrap();
    for again in [
        block(1, 0, 0),
        PeerMsg::Miss { req: 1, idx: 0 },
        slot(1, 0, 0),
    ] {
        assert!(matches!(
            violation(p.feed(again)),
            Violation::AnsweredTwice { key: 0 }
        ));
    }
    // A key whose GET is in flight is answered already, though still open.
    let Step::Body(a) = p.feed(slot(1, 1, 1)).unwrap() else {
        panic!("a Slot is a body to GET");
    };
    assert_eq!(
        a.body,
        Body::Remote {
            addr: 0x2000,
            seal: Vec::new()
        }
    );
    p.m.get_started(a.i, a.req, ());
    assert!(matches!(
        violation(p.feed(slot(1, 1, 1))),
        Violation::AnsweredTwice { key: 1 }
    ));
    assert_eq!(p.committed, vec![0]);
}

#[test]
fn done_before_every_key_is_answered_or_landed_is_a_violation() {
    let mut p = Pull::new(2, 2, None);
    p.feed(block(1, 0, 0)).unwrap();
    assert!(matches!(
        violation(p.feed(PeerMsg::Done { req: 1 })),
        Violation::Unanswered { req: 1 }
    ));
    // A GET not yet landed leaves its key unanswered.
    let mut p = Pull::new(1, 1, None);
    p.get_of_first_slot();
    assert!(p.m.gets_for(Some(1)) && !p.m.gets_for(Some(2)));
    assert!(matches!(
        p.m.get_landed(5),
        Err(Violation::GetNotInFlight { key: 5 })
    ));
    assert!(matches!(
        violation(p.feed(PeerMsg::Done { req: 1 })),
        Violation::Unanswered { req: 1 }
    ));
    // Landed and checked, the request closes.
    let mut p = Pull::new(1, 1, None);
    let a = p.get_of_first_slot();
    p.m.get_landed(0).unwrap();
    let v =
        p.m.body_in(0, &a.hash, Checked::Hashed(hash_of(0)))
            .unwrap();
    p.settle(0, v);
    p.feed(PeerMsg::Done { req: 1 }).unwrap();
    assert!(p.m.is_done() && !p.m.gets_for(None));
}

#[test]
fn a_checksum_mismatch_fails_only_its_key_and_the_stream_goes_on() {
    let mut p = Pull::new(4, 4, None);
    p.feed(block(1, 0, 0)).unwrap();
    // Key 1's header names other bytes than those that arrive.
    let mut bad = block(1, 1, 1);
    if let PeerMsg::Block { hash, .. } = &mut bad {
        hash[0] ^= 1;
    }
    p.feed(bad).unwrap();
    // Key 2 checked by block MAC, and it did not match.
    let Step::Body(a) = p.m.handle_frame(block(1, 2, 2)).unwrap() else {
        panic!("a Block is a body");
    };
    let refused = Checked::Tagged {
        ok: false,
        id: 3,
        tag: [0; 16],
    };
    let v = p.m.body_in(a.i, &a.hash, refused).unwrap();
    assert_eq!(v, Verdict::Mismatch(Check::BlockMac));
    p.settle(a.i, v);
    p.feed(block(1, 3, 3)).unwrap();
    p.feed(PeerMsg::Done { req: 1 }).unwrap();
    assert_eq!(p.committed, vec![0, 3]);
    let r = p.results();
    assert_eq!(r[0], KeyOutcome::Pulled);
    assert_eq!(r[3], KeyOutcome::Pulled);
    for (i, by) in [(1, "BLAKE3"), (2, "block MAC")] {
        let KeyOutcome::Failed(f) = &r[i] else {
            panic!("key {i}: {:?}", r[i]);
        };
        assert_eq!(f.code, FailCode::Checksum);
        assert!(f.message.contains(by), "{}", f.message);
    }
    assert_eq!(p.op.report().state, OpState::Partial);
    // A matching tag commits, and hands the tag on to be kept.
    let mut p = Pull::new(1, 1, None);
    let Step::Body(a) = p.m.handle_frame(block(1, 0, 0)).unwrap() else {
        panic!("a Block is a body");
    };
    let good = Checked::Tagged {
        ok: true,
        id: 3,
        tag: [4; 16],
    };
    assert_eq!(
        p.m.body_in(a.i, &a.hash, good).unwrap(),
        Verdict::Commit {
            tag: Some((3, [4; 16]))
        }
    );
}

#[test]
fn after_a_cancel_no_byte_reaches_the_client_buffers_and_no_key_is_set() {
    let mut p = Pull::new(3, 3, None);
    p.feed(block(1, 0, 0)).unwrap();
    let why = Failure::new(FailCode::Cancelled, "cancelled by the client");
    p.op.end(OpState::Cancelled, &why);
    let before = p.results();
    // The source goes on answering: the pull goes on, late blocks are kept (committed to
    // the DRAM tier), but the op's buffers and outcomes no longer change.
    p.feed(block(1, 1, 1)).unwrap();
    p.feed(PeerMsg::Miss { req: 1, idx: 2 }).unwrap();
    p.feed(PeerMsg::Done { req: 1 }).unwrap();
    assert_eq!(p.committed, vec![0, 1]);
    assert_eq!(p.results(), before);
    assert_eq!(before[0], KeyOutcome::Pulled);
    assert_eq!(before[1], KeyOutcome::Failed(why.clone()));
    assert_eq!(before[2], KeyOutcome::Failed(why));
    let bufs = p.buffers();
    assert_eq!(bufs[0], bytes(0));
    assert!(
        bufs[1].iter().all(|&b| b == 0),
        "a byte landed after the cancel"
    );
    assert_eq!(p.op.report().state, OpState::Cancelled);
}

#[test]
fn past_the_deadline_the_open_keys_fail_with_its_reason_and_nothing_after_is_committed() {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(10);
    let mut p = Pull::new(3, 3, Some(deadline));
    // The waits shrink to what is left of the deadline, never below 1 ms.
    let io = Duration::from_secs(1);
    assert_eq!(p.m.wait_limit(t0, io), Duration::from_millis(10));
    assert_eq!(p.m.wait_limit(deadline, io), Duration::from_millis(1));
    p.m.handle_timeout(t0 + Duration::from_millis(9)).unwrap();
    p.feed(block(1, 0, 0)).unwrap();
    // A wait that timed out before the deadline stays what it was.
    let early = PeerError::timeout(Stage::Answer, io);
    let early = p.m.on_error(t0 + Duration::from_millis(9), early);
    assert_eq!(early.timed_out(), Some(Stage::Answer));
    let Err(e) = p.m.handle_timeout(deadline) else {
        panic!("the deadline passed");
    };
    assert!(matches!(e, PullError::Deadline));
    // Nothing after it is taken: not a frame, not a body already read.
    assert!(matches!(
        p.feed(block(1, 1, 1)),
        Err(PeerError::Pull(PullError::Deadline))
    ));
    assert!(matches!(
        p.m.body_in(2, &hash_of(2), Checked::Hashed(hash_of(2))),
        Err(PeerError::Pull(PullError::Deadline))
    ));
    let late =
        p.m.on_error(deadline, PeerError::timeout(Stage::Answer, io));
    assert!(matches!(late, PeerError::Pull(PullError::Deadline)));
    p.fail(&late);
    assert_eq!(p.committed, vec![0]);
    let r = p.results();
    assert_eq!(r[0], KeyOutcome::Pulled);
    for k in [1, 2] {
        assert!(
            matches!(&r[k], KeyOutcome::Failed(f) if f.code == FailCode::Deadline),
            "key {k}: {:?}",
            r[k]
        );
    }
}

#[test]
fn without_a_deadline_time_never_ends_the_pull() {
    let t0 = Instant::now();
    let mut p = Pull::new(1, 1, None);
    let io = Duration::from_secs(1);
    assert_eq!(p.m.wait_limit(t0, io), io);
    p.m.handle_timeout(t0 + Duration::from_hours(1)).unwrap();
    let e = p.m.on_error(t0, PeerError::timeout(Stage::Answer, io));
    assert_eq!(e.timed_out(), Some(Stage::Answer));
    p.feed(block(1, 0, 0)).unwrap();
    assert_eq!(p.committed, vec![0]);
}

#[test]
fn misses_pongs_refusals_and_stray_messages_are_told_apart() {
    let mut p = Pull::new(2, 2, None);
    assert_eq!(p.feed(PeerMsg::Pong { t: 5 }).unwrap(), Step::Nothing);
    assert_eq!(
        p.feed(PeerMsg::Miss { req: 1, idx: 1 }).unwrap(),
        Step::Outcome {
            key: 1,
            outcome: KeyOutcome::Missed
        }
    );
    assert_eq!(p.results()[1], KeyOutcome::Missed);
    let refused = p.feed(PeerMsg::Refused {
        reason: "going away".into(),
    });
    assert!(matches!(refused, Err(PeerError::Handshake(_))));
    assert!(matches!(
        violation(p.feed(PeerMsg::Landed { req: 1 })),
        Violation::FromSource { .. }
    ));
    let mut short = block(1, 0, 0);
    if let PeerMsg::Block { hash, .. } = &mut short {
        hash.truncate(5);
    }
    assert!(matches!(
        violation(p.feed(short)),
        Violation::HashLength { len: 5 }
    ));
    assert!(p.committed.is_empty());
}
