//! Sizes a client declares (Register segments, Put and Alloc lengths) against a real daemon:
//! the attack from issue 15 (a slot of 2^64-1 whose class rounded to 0, then a Put that
//! divided by zero under the DRAM tier lock and left every client disconnected), a property
//! test over Register/Put/Alloc parameters, the `kvnode put` CLI with such sizes, and the
//! largest pull deadline a client can state. After
//! each, the daemon answers every client and the committed reference blocks are unchanged.
//! Run: `cargo test --release -p kvnode-e2e --test bad_sizes`.

use std::cell::RefCell;
use std::process::Command;

use kvnode_client::{Client, ClientError};
use kvnode_e2e::raw::Raw;
use kvnode_e2e::{Daemon, assert_unchanged, key, kvnode_bin, seed_blocks, spec, temp_dir};
use kvnode_proto::client::{AllocSlot, ErrorCode, Op, PutStatus, Reply, Request};
use kvnode_proto::namespace::MAX_SLOT_BYTES;
use kvnode_proto::{Key, NamespaceSpec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Slab size the daemons below run with (`--slab-size`): the largest registrable slot.
const SLAB: u64 = 1 << 20;

fn daemon() -> Daemon {
    Daemon::start(&[
        "--dram",
        "256MiB",
        "--slab-size",
        "1MiB",
        "--no-pin",
        "--no-populate",
    ])
}

fn refused(r: Result<impl std::fmt::Debug, ClientError>) -> (ErrorCode, String) {
    match r {
        Err(ClientError::Server { code, message }) => (code, message),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn a_slot_of_u64_max_is_refused_at_register_and_every_client_keeps_being_served() {
    let d = daemon();
    let (mut c, ns, keys, data) = seed_blocks(&d);
    let mut attacker = d.client();
    for size in [u64::MAX, u64::MAX - 4095, MAX_SLOT_BYTES + 1] {
        let (code, msg) = refused(attacker.register(&spec("attack", size)));
        assert_eq!(code, ErrorCode::Invalid, "{msg}");
        assert!(msg.contains("at most 1099511627776 (1 TiB)"), "{msg}");
    }
    // Registrable by the protocol, larger than this daemon's slab: refused by the tier.
    let (code, msg) = refused(attacker.register(&spec("attack", SLAB + 1)));
    assert_eq!(code, ErrorCode::Unsupported, "{msg}");
    assert!(msg.contains("exceeds the slab size"), "{msg}");
    // The Put that used to divide by zero: there is no namespace to put into.
    let (code, _) = refused(attacker.put(ns + 1, &[key(1)], &[&[7u8; 16]]));
    assert_eq!(code, ErrorCode::UnknownNamespace);
    // The attacker's own connection, the reference client and a new client all work.
    attacker.stats().unwrap();
    assert_unchanged(&mut c, ns, &keys, &data);
    d.client().stats().unwrap();
}

/// A declared size: the edges around alignment, the slab, the protocol limit and u64.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop::sample::select(vec![
            0,
            1,
            4095,
            4096,
            4097,
            SLAB - 1,
            SLAB,
            SLAB + 1,
            MAX_SLOT_BYTES,
            MAX_SLOT_BYTES + 1,
            u64::MAX - 4095,
            u64::MAX,
        ]),
        1..=SLAB,
        any::<u64>(),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// Put real bytes of these lengths (segment index of each key).
    Put(Vec<(u16, u64)>),
    /// Put whose declared lengths need not match the payload it sends.
    PutLying(Vec<u64>, usize),
    /// Alloc of these lengths (segment index of each key), aborted afterwards.
    Alloc(Vec<(u16, u64)>),
}

fn step() -> impl Strategy<Value = Step> {
    let seg = 0..4u16;
    prop_oneof![
        prop::collection::vec((seg.clone(), 0..20_000u64), 1..4).prop_map(Step::Put),
        (prop::collection::vec(size(), 0..4), 0..64usize).prop_map(|(l, p)| Step::PutLying(l, p)),
        prop::collection::vec((seg, size()), 0..4).prop_map(Step::Alloc),
    ]
}

fn seg_key(i: u64, seg: u16) -> Key {
    Key(key(i).0, seg)
}

/// Where a case's steps go: namespace `ns` with its declared `segments`, or (`None`) a
/// handle that was never registered. `n` numbers the keys so none repeats.
struct Target<'a> {
    d: &'a Daemon,
    ns: u32,
    segments: Option<&'a [u64]>,
    n: u64,
}

impl Target<'_> {
    fn declared(&self, seg: u16) -> Option<u64> {
        self.segments.and_then(|v| v.get(usize::from(seg)).copied())
    }

    fn keys(&mut self, segs: impl Iterator<Item = u16>) -> Vec<Key> {
        segs.map(|sg| {
            self.n += 1;
            seg_key(self.n, sg)
        })
        .collect()
    }

    /// An error reply is only right for a handle that was never registered.
    fn unknown_namespace(&self, e: ClientError) {
        let (code, msg) = refused(Err::<(), _>(e));
        assert!(
            self.segments.is_none() && code == ErrorCode::UnknownNamespace,
            "{code:?}: {msg}"
        );
    }

    /// Runs one step on `c`, checking that the daemon answers it and that what it grants
    /// fits what was declared.
    fn run(&mut self, c: &mut Client, s: &Step) {
        match s {
            Step::Put(items) => self.put(c, items),
            Step::PutLying(lens, payload) => self.put_lying(lens, *payload),
            Step::Alloc(items) => self.alloc(c, items),
        }
    }

    fn put(&mut self, c: &mut Client, items: &[(u16, u64)]) {
        let keys = self.keys(items.iter().map(|i| i.0));
        let bytes: Vec<Vec<u8>> = items.iter().map(|&(_, l)| vec![0xA5; l as usize]).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        match c.put(self.ns, &keys, &refs) {
            Ok(res) => {
                for (&(sg, len), st) in items.iter().zip(&res) {
                    match (self.declared(sg), st) {
                        (Some(slot), PutStatus::Stored) => {
                            assert!(len <= slot, "stored {len} in a slot of {slot}");
                        }
                        (Some(slot), PutStatus::TooLarge) => assert!(len > slot),
                        (None, PutStatus::BadSegment) | (Some(_), PutStatus::NoSpace) => {}
                        other => panic!("put of {len} bytes in segment {sg}: {other:?}"),
                    }
                }
            }
            Err(e) => self.unknown_namespace(e),
        }
    }

    fn put_lying(&mut self, lens: &[u64], payload: usize) {
        let mut r = Raw::connect(self.d, true);
        let keys = self.keys(lens.iter().map(|_| 0));
        let op = Op::Put {
            ns: self.ns,
            keys,
            lens: lens.to_vec(),
            meta: vec![],
        };
        r.send(&Request { id: 2, op }, &vec![0x5A; payload]);
        let reply = r
            .recv()
            .expect("the daemon answers a Put whose lengths lie")
            .reply;
        let honest = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l)) == Some(payload as u64);
        match reply {
            Reply::Error { code, .. } if !honest => assert_eq!(code, ErrorCode::Invalid),
            Reply::Error {
                code: ErrorCode::UnknownNamespace,
                ..
            } if self.segments.is_none() => {}
            Reply::Put { results } if honest => assert_eq!(results.len(), lens.len()),
            other => panic!("Put lens {lens:?} with {payload} payload bytes: {other:?}"),
        }
    }

    fn alloc(&mut self, c: &mut Client, items: &[(u16, u64)]) {
        let keys = self.keys(items.iter().map(|i| i.0));
        let lens: Vec<u64> = items.iter().map(|&(_, l)| l).collect();
        let slots = match c.alloc(self.ns, &keys, &lens) {
            Ok(s) => s,
            Err(e) => return self.unknown_namespace(e),
        };
        let mut handles = Vec::new();
        for (&(sg, len), slot) in items.iter().zip(&slots) {
            let refused = |status| matches!(slot, AllocSlot::Refused { status: s } if *s == status);
            match (self.declared(sg), slot) {
                (Some(slot_bytes), AllocSlot::Granted { handle, len: l, .. }) => {
                    assert!(
                        len <= slot_bytes && *l == len,
                        "granted {l} for {len} in a slot of {slot_bytes}"
                    );
                    handles.push(*handle);
                }
                (Some(slot_bytes), _) if refused(PutStatus::TooLarge) => {
                    assert!(len > slot_bytes);
                }
                (None, _) if refused(PutStatus::BadSegment) => {}
                (Some(_), _) if refused(PutStatus::NoSpace) => {}
                other => panic!("alloc of {len} bytes in segment {sg}: {other:?}"),
            }
        }
        assert_eq!(c.abort(&handles).unwrap() as usize, handles.len());
    }
}

#[test]
fn register_put_and_alloc_sizes_get_answers_and_never_hurt_other_clients() {
    let mut d = daemon();
    let (c, ref_ns, keys, data) = seed_blocks(&d);
    let reference = RefCell::new(c);
    let n = RefCell::new(1_000_000u64);
    let model = RefCell::new(0u64);
    let registered = RefCell::new(0u64);
    let case = (
        prop::collection::vec(size(), 0..4),
        prop::collection::vec(step(), 1..6),
    );
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    runner
        .run(&case, |(segments, steps)| {
            let mut c = d.client();
            *model.borrow_mut() += 1;
            let spec = NamespaceSpec {
                segments: segments.clone(),
                ..spec(&format!("prop-{}", model.borrow()), 1)
            };
            let valid = !segments.is_empty() && segments.iter().all(|&s| (1..=SLAB).contains(&s));
            let ns = match c.register(&spec) {
                Ok(r) => {
                    assert!(valid, "registered {segments:?}");
                    *registered.borrow_mut() += 1;
                    Some(r.ns)
                }
                Err(e) => {
                    let (code, msg) = refused(Err::<(), _>(e));
                    assert!(!valid, "{segments:?} refused: {msg}");
                    assert!(
                        matches!(code, ErrorCode::Invalid | ErrorCode::Unsupported),
                        "{code:?}: {msg}"
                    );
                    None
                }
            };
            let mut target = Target {
                d: &d,
                ns: ns.unwrap_or(ref_ns + 100_000),
                segments: ns.map(|_| segments.as_slice()),
                n: *n.borrow(),
            };
            for s in &steps {
                target.run(&mut c, s);
            }
            *n.borrow_mut() = target.n;
            c.stats().expect("this connection is still served");
            assert_unchanged(&mut reference.borrow_mut(), ref_ns, &keys, &data);
            Ok(())
        })
        .unwrap();
    // The cases ran, and both sides of the size rules were exercised.
    let (cases, ok) = (*model.borrow(), *registered.borrow());
    assert!(
        cases >= 64 && ok > 0 && ok < cases,
        "{cases} cases, {ok} registered"
    );
    assert!(
        d.child.try_wait().unwrap().is_none(),
        "the daemon is still running"
    );
}

#[test]
fn kvnode_put_with_a_huge_page_size_is_a_clear_error_not_a_panic() {
    let d = daemon();
    let (mut c, ns, keys, data) = seed_blocks(&d);
    let small = temp_dir("bad-sizes").join("small.bin");
    std::fs::write(&small, [1u8; 100]).unwrap();
    let hex = key(77).0.to_hex();
    for bytes in [["--file", small.to_str().unwrap()], ["--seed", "1"]] {
        let o = Command::new(kvnode_bin())
            .args(["put", "--socket"])
            .arg(d.socket())
            .args(["--page-bytes", "18446744073709551615", "--keys", &hex])
            .args(bytes)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains("at most 1099511627776 (1 TiB)"), "{err}");
    }
    assert_unchanged(&mut c, ns, &keys, &data);
}

/// The largest deadline a client can state (u64::MAX ms) is a long wait, not an overflow.
#[test]
fn a_pull_deadline_of_u64_max_is_answered_and_the_daemon_keeps_serving() {
    let port = kvnode_e2e::free_port();
    let src = kvnode_e2e::peer_source(port, &[]);
    let mut dst = kvnode_e2e::peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", 4096)).unwrap().ns;
    s.put(sns, &keys, &[&[1u8; 4096], &[2u8; 4096]]).unwrap();
    let mut c = dst.client();
    let ns = c.register(&spec("m", 4096)).unwrap().ns;
    let hint = kvnode_e2e::hint(port, &keys);
    let r = c.get_hinted(ns, &keys, Some(&hint), Some(u64::MAX));
    let r2 = c.pull(ns, &keys, &hint, &[], Some(u64::MAX));
    assert!(
        dst.child.try_wait().unwrap().is_none(),
        "the daemon died: {r:?} {r2:?}\n{}",
        dst.log()
    );
    let (pages, _) = r.unwrap();
    assert!(pages.iter().all(Option::is_some));
    r2.unwrap();
    c.stats().expect("this connection is still served");
}
