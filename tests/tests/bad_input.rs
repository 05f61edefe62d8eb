//! Bad input over the client socket: each case gets a clear error frame, at worst that
//! connection is dropped, the daemon and other clients carry on and no committed block
//! changes. Includes a property test that throws random frames at a live daemon.
//! Run: `cargo test --release -p kvnode-e2e --test bad_input`.

use std::collections::BTreeMap;
use std::io::Write;

use kvnode_e2e::raw::Raw;
use kvnode_e2e::{Daemon, assert_unchanged, key, seed_blocks, spec};
use kvnode_proto::PROTOCOL_VERSION;
use kvnode_proto::client::{CommitStatus, ErrorCode, Op, PutStatus, Reply, Request};
use kvnode_proto::frame::FramePrefix;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[derive(serde::Serialize)]
struct WeirdRequest {
    id: u64,
    op: BTreeMap<String, BTreeMap<String, serde_bytes_like::Bytes>>,
}

mod serde_bytes_like {
    /// Serializes as msgpack bin.
    pub struct Bytes(pub Vec<u8>);
    impl serde::Serialize for Bytes {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&self.0)
        }
    }
}

#[test]
fn handshake_errors_are_reported_and_the_connection_closed() {
    let d = Daemon::start(&["--dram", "16MiB"]);
    let mut r = Raw::connect(&d, false);
    r.send(
        &Request {
            id: 1,
            op: Op::Hello {
                version: 99,
                client: "x".into(),
            },
        },
        &[],
    );
    assert!(r.expect_error(ErrorCode::Handshake).contains("version 99"));
    assert!(r.closed());
    let mut r = Raw::connect(&d, false);
    r.send(
        &Request {
            id: 1,
            op: Op::Stats,
        },
        &[],
    );
    assert!(r.expect_error(ErrorCode::Handshake).contains("Hello"));
    assert!(r.closed());
    d.client().stats().unwrap();
}

#[test]
fn malformed_frames_get_clear_errors_and_nothing_changes() {
    let d = Daemon::start(&["--dram", "16MiB"]);
    let (mut c, ns, keys, data) = seed_blocks(&d);
    // One connection through every refusal that keeps it open; it still works after.
    let mut r = Raw::connect(&d, true);
    undecodable_headers(&mut r, ns);
    refused_puts(&mut r, ns, &keys);
    leases_and_hello_after_errors(&mut r, ns, &keys);
    // Then frames that end their connection.
    broken_frames(&d);
    assert_unchanged(&mut c, ns, &keys, &data);
    assert_eq!(c.stats().unwrap().tiers[0].blocks, 16);
}

/// An unknown op, a key of the wrong length, a payload on an op that takes none: each an
/// error, the connection goes on.
fn undecodable_headers(r: &mut Raw, ns: u32) {
    // Unknown op: decodable frame, undecodable header. Error, connection continues.
    let mut inner = BTreeMap::new();
    inner.insert("x".to_owned(), serde_bytes_like::Bytes(vec![1]));
    let mut op = BTreeMap::new();
    op.insert("Frobnicate".to_owned(), inner);
    r.send(&WeirdRequest { id: 5, op }, &[]);
    r.expect_error(ErrorCode::Malformed);
    // Key of the wrong length (31 bytes).
    let mut inner = BTreeMap::new();
    inner.insert("ns".to_owned(), serde_bytes_like::Bytes(vec![]));
    let mut op = BTreeMap::new();
    op.insert("Exists".to_owned(), inner);
    r.send(&WeirdRequest { id: 6, op }, &[]);
    r.expect_error(ErrorCode::Malformed);
    let short_key = rmp_serde::to_vec_named(&serde_json_like(ns)).unwrap();
    let mut f = FramePrefix {
        header_len: short_key.len() as u32,
        payload_len: 0,
    }
    .encode()
    .to_vec();
    f.extend_from_slice(&short_key);
    r.0.write_all(&f).unwrap();
    assert!(r.expect_error(ErrorCode::Malformed).contains("32 bytes"));
    // Payload on an op that takes none: skipped, error, connection continues.
    r.send(
        &Request {
            id: 7,
            op: Op::Stats,
        },
        &[1, 2, 3],
    );
    r.expect_error(ErrorCode::Invalid);
}

/// Puts refused for their lengths, namespace, size or an existing key: nothing stored.
fn refused_puts(r: &mut Raw, ns: u32, keys: &[kvnode_proto::Key]) {
    // Put whose lengths disagree with its payload.
    r.send(
        &Request {
            id: 8,
            op: Op::Put {
                ns,
                meta: vec![],
                keys: vec![key(900)],
                lens: vec![10],
            },
        },
        &[0; 4],
    );
    r.expect_error(ErrorCode::Invalid);
    // Unknown namespace handle.
    r.send(
        &Request {
            id: 9,
            op: Op::Exists {
                hint: None,
                ns: 4242,
                keys: vec![key(1)],
                recompute: None,
            },
        },
        &[],
    );
    assert!(r.expect_error(ErrorCode::UnknownNamespace).contains("4242"));
    // Hostile recompute costs: each refused by the field it breaks, nothing planned.
    for (i, (tps, page, field)) in [
        (f64::NAN, 16, "tokens_per_s"),
        (-1.0, 16, "tokens_per_s"),
        (f64::INFINITY, 16, "tokens_per_s"),
        (1000.0, 0, "page_tokens"),
    ]
    .into_iter()
    .enumerate()
    {
        r.send(
            &Request {
                id: 100 + i as u64,
                op: Op::Exists {
                    hint: None,
                    ns,
                    keys: vec![key(1)],
                    recompute: Some(kvnode_proto::plan::RecomputeCost {
                        ctx_s: None,
                        prompt_tokens: None,
                        page_tokens: page,
                        keys_per_page: 1,
                        tokens_per_s: tps,
                        quad_s: 0.0,
                        start_tokens: 0,
                        via: kvnode_proto::plan::ReadPath::Copy,
                    }),
                },
            },
            &[],
        );
        assert!(r.expect_error(ErrorCode::Invalid).contains(field));
    }
    // Put larger than the segment's slot.
    let big = vec![9u8; 8193];
    r.send(
        &Request {
            id: 10,
            op: Op::Put {
                ns,
                meta: vec![],
                keys: vec![key(901)],
                lens: vec![8193],
            },
        },
        &big,
    );
    assert!(
        matches!(r.recv().unwrap().reply, Reply::Put { results } if results == vec![PutStatus::TooLarge])
    );
    // Put over an existing key: refused as Exists, bytes unchanged.
    r.send(
        &Request {
            id: 11,
            op: Op::Put {
                ns,
                meta: vec![],
                keys: vec![keys[0]],
                lens: vec![8192],
            },
        },
        &[0xEE; 8192],
    );
    assert!(
        matches!(r.recv().unwrap().reply, Reply::Put { results } if results == vec![PutStatus::Exists])
    );
}

/// A double release, a release never taken and a second Hello are refused; the connection
/// still answers after all of it.
fn leases_and_hello_after_errors(r: &mut Raw, ns: u32, keys: &[kvnode_proto::Key]) {
    // Double release, and release of a lease never taken.
    r.send(
        &Request {
            id: 12,
            op: Op::Get {
                hint: None,
                deadline_ms: None,
                ns,
                keys: keys[..2].to_vec(),
                mode: kvnode_proto::GetMode::Lease,
            },
        },
        &[],
    );
    let Reply::GetLease { lease, .. } = r.recv().unwrap().reply else {
        panic!()
    };
    r.send(
        &Request {
            id: 13,
            op: Op::Release { lease },
        },
        &[],
    );
    assert!(matches!(r.recv().unwrap().reply, Reply::Released));
    r.send(
        &Request {
            id: 14,
            op: Op::Release { lease },
        },
        &[],
    );
    r.expect_error(ErrorCode::NotOwned);
    // Hello again mid-connection.
    r.send(
        &Request {
            id: 15,
            op: Op::Hello {
                version: PROTOCOL_VERSION,
                client: "again".into(),
            },
        },
        &[],
    );
    r.expect_error(ErrorCode::Invalid);
    // The connection still works.
    r.send(
        &Request {
            id: 16,
            op: Op::Exists {
                hint: None,
                ns,
                keys: keys.to_vec(),
                recompute: None,
            },
        },
        &[],
    );
    assert!(matches!(
        r.recv().unwrap().reply,
        Reply::Exists { count: 16, .. }
    ));
}

/// An impossible length prefix (error, then closed) and a truncated frame with a hang-up.
fn broken_frames(d: &Daemon) {
    // A prefix with an impossible length: error frame, then the connection is dropped.
    let mut bad = Raw::connect(d, true);
    bad.0
        .write_all(
            &FramePrefix {
                header_len: 0,
                payload_len: 0,
            }
            .encode(),
        )
        .unwrap();
    bad.expect_error(ErrorCode::Malformed);
    assert!(bad.closed());
    let mut bad = Raw::connect(d, true);
    let mut huge = [0u8; 8];
    huge[..4].copy_from_slice(&(u32::MAX).to_le_bytes());
    bad.0.write_all(&huge).unwrap();
    bad.expect_error(ErrorCode::Malformed);
    assert!(bad.closed());
    // A truncated frame followed by a hang-up.
    let mut t = Raw::connect(d, true);
    t.0.write_all(
        &FramePrefix {
            header_len: 100,
            payload_len: 0,
        }
        .encode(),
    )
    .unwrap();
    t.0.write_all(&[0x80; 10]).unwrap();
    drop(t);
}

fn serde_json_like(ns: u32) -> impl serde::Serialize {
    #[derive(serde::Serialize)]
    struct Exists {
        ns: u32,
        keys: Vec<(serde_bytes_like::Bytes, u16)>,
    }
    #[derive(serde::Serialize)]
    enum O {
        Exists(Exists),
    }
    #[derive(serde::Serialize)]
    struct R {
        id: u64,
        op: O,
    }
    R {
        id: 17,
        op: O::Exists(Exists {
            ns,
            keys: vec![(serde_bytes_like::Bytes(vec![1; 31]), 0)],
        }),
    }
}

#[test]
fn a_connection_cannot_commit_or_abort_another_connections_slot() {
    let d = Daemon::start(&["--dram", "16MiB"]);
    let mut a = d.client();
    let mut b = d.client();
    let ns = a.register(&spec("m", 4096)).unwrap().ns;
    b.register(&spec("m", 4096)).unwrap();
    let slots = a.alloc(ns, &[key(1)], &[4096]).unwrap();
    let kvnode_proto::client::AllocSlot::Granted { handle, .. } = slots[0] else {
        panic!()
    };
    assert_eq!(
        b.commit(&[handle]).unwrap(),
        vec![CommitStatus::UnknownHandle]
    );
    assert_eq!(b.abort(&[handle]).unwrap(), 0);
    assert_eq!(b.exists(ns, &[key(1)]).unwrap(), 0);
    assert_eq!(a.commit(&[handle]).unwrap(), vec![CommitStatus::Committed]);
    assert_eq!(b.exists(ns, &[key(1)]).unwrap(), 1);
}

/// Random frames (valid prefixes with random headers and payloads, and pure garbage)
/// never crash the daemon nor change a committed block. One daemon serves every case and
/// is stopped when the test ends (it lives in this function, not in a static).
#[test]
fn random_frames_never_crash_the_daemon_or_change_blocks() {
    let mut d = Daemon::start(&["--dram", "16MiB"]);
    let (c, ns, keys, data) = seed_blocks(&d);
    let c = std::cell::RefCell::new(c);
    let frames = proptest::collection::vec(
        (
            proptest::collection::vec(any::<u8>(), 1..200),
            proptest::collection::vec(any::<u8>(), 0..64),
            any::<bool>(),
        ),
        1..8,
    );
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    runner
        .run(&frames, |frames| {
            let mut r = Raw::connect(&d, true);
            for (header, payload, garbage) in frames {
                let mut bytes = if garbage {
                    header.clone()
                } else {
                    FramePrefix {
                        header_len: header.len() as u32,
                        payload_len: payload.len() as u32,
                    }
                    .encode()
                    .to_vec()
                };
                if !garbage {
                    bytes.extend_from_slice(&header);
                    bytes.extend_from_slice(&payload);
                }
                if r.0.write_all(&bytes).is_err() {
                    break;
                }
            }
            drop(r);
            assert_unchanged(&mut c.borrow_mut(), ns, &keys, &data);
            Ok(())
        })
        .unwrap();
    assert!(
        d.child.try_wait().unwrap().is_none(),
        "the daemon is still running"
    );
}
