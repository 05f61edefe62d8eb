//! A small hinted pull (at most 4 keys) that its client's request awaits is received on the
//! request's own worker thread (`peer::fetch`, `Chunk::pull_blocking`), bounded by the op's
//! deadline as well as the io timeout. Against a scripted source that takes the `Pull` and
//! then stalls:
//! - the get is answered at its 300 ms deadline, not at the 10 s io timeout, with the key
//!   failed `Deadline`;
//! - the abandoned connection is not reused: the next pull dials anew and lands its key,
//!   so the daemon is neither stuck nor deaf.
//!
//! Run: `cargo test --release -p kvnode-e2e --test pull_in_place`.

use std::net::TcpListener;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvnode_e2e::peerwire::{accept_pull, send_block};
use kvnode_e2e::{block, hint, key, peer_dest, spec};
use kvnode_proto::Key;
use kvnode_proto::peer::PeerMsg;
use kvnode_proto::pull::{FailCode, KeyOutcome, OpState};

const PAGE: usize = 64 << 10;

#[test]
fn a_small_pull_from_a_stalled_source_ends_at_its_deadline_and_the_next_one_lands() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let dst = peer_dest(
        &format!("tcp://127.0.0.1:{port}"),
        &["--peer-io-timeout-ms", "10000"],
    );
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let (released_tx, released) = mpsc::channel::<()>();
    let src = std::thread::spawn(move || {
        // First connection: take the Pull, answer nothing until the test has its reply.
        let (stalled, _, n) = accept_pull(&l);
        assert_eq!(n, 1);
        released.recv().unwrap();
        drop(stalled);
        // The destination must dial again for the second pull, and gets its block.
        let (mut w, req, n) = accept_pull(&l);
        assert_eq!(n, 1);
        send_block(&mut w, req, 0, &block(1, PAGE));
        w.send(&PeerMsg::Done { req }, &[]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });

    let first: Vec<Key> = vec![key(0)];
    let t = Instant::now();
    let (lease, op) = c
        .get_lease_hinted(ns, &first, Some(&hint(port, &first)), Some(300))
        .unwrap();
    let took = t.elapsed();
    released_tx.send(()).unwrap();
    let op = op.expect("a pull report");
    // Bounded at a third of the io timeout: the deadline (300 ms) ended it, with headroom
    // for a loaded machine, while a wait for the io timeout still fails the check.
    assert!(
        took < Duration::from_millis(3300),
        "a stalled small pull took {took:?} (deadline 300 ms, io timeout 10 s): {op:?}"
    );
    // Nothing landed, so nothing is leased (lease 0).
    assert_eq!((lease.leading_hits(), lease.id), (0, 0), "{op:?}");
    assert!(
        matches!(&op.results[0], KeyOutcome::Failed(f) if f.code == FailCode::Deadline),
        "{op:?}"
    );

    let second: Vec<Key> = vec![key(1)];
    let (lease, op) = c
        .get_lease_hinted(ns, &second, Some(&hint(port, &second)), Some(20_000))
        .unwrap();
    let op = op.expect("a pull report");
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert_eq!(lease.leading_hits(), 1, "{op:?}");
    c.release(lease.id).unwrap();
    let got = c.get(ns, &second).unwrap();
    assert_eq!(got[0].as_deref(), Some(&block(1, PAGE)[..]));
    src.join().unwrap();
}
