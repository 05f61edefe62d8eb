//! A takeover while the old daemon serves (issue 42 item 1), against real daemon processes:
//! the successor builds its DRAM tier from a live image while the donor keeps answering,
//! then takes the delta of the slots changed meanwhile at the barrier.
//!
//! - A client putting and getting without a pause across the takeover never sees an error, a
//!   wrong byte or a lost block (the donor closes connections only between requests, and
//!   the client library sends a request that found its connection closed again on a new
//!   one: engine/client/src/retry.rs), and every block it put, during the build included,
//!   is readable from the successor.
//! - Blocks deleted and put on the donor while the successor builds (the build held open by
//!   the test seam `KVNODE_TEST_TAKEOVER_BUILD_PAUSE_MS`) are as the donor left them: without
//!   the delta the deleted block's slot, reused by a new block, would be served under the
//!   deleted key with the new block's bytes.
//!
//! Needs a daemon built with the test seams: `cargo build --release -p kvnode -p kvnode-e2e`
//! (one invocation: the seams come by feature unification), then
//! `cargo test --release -p kvnode-e2e --test takeover_live`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::{Daemon, block, key, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::client::PutStatus;

const LEN: usize = 64 << 10;
const PAUSE_ENV: &str = "KVNODE_TEST_TAKEOVER_BUILD_PAUSE_MS";

fn put_range(c: &mut Client, ns: u32, range: std::ops::Range<u64>) {
    for i in range {
        let st = c.put(ns, &[key(i)], &[&block(i, LEN)]).expect("put");
        assert_eq!(st[0], PutStatus::Stored, "block {i}");
    }
}

/// Blocks of `idx` that come back, checking their bytes.
fn intact(c: &mut Client, ns: u32, idx: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    for chunk in idx.chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        for (g, &i) in c.get(ns, &keys).expect("get").iter().zip(chunk) {
            if let Some(b) = g {
                assert!(*b == block(i, LEN), "block {i} came back with other bytes");
                out.push(i);
            }
        }
    }
    out
}

fn wait_for(d: &Daemon, what: &str, limit: Duration) {
    let t = Instant::now();
    while !d.log().contains(what) {
        assert!(t.elapsed() < limit, "no `{what}` in the log:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A client that gets kept blocks and puts new ones (every 4th request) on one `Client`
/// until `done`; any error fails the test (the client library sends a request the takeover
/// cut again on a new connection). Returns the blocks it put.
fn churn(
    sock: std::path::PathBuf,
    kept: u64,
    done: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
) -> std::thread::JoinHandle<Vec<u64>> {
    std::thread::spawn(move || {
        let mut c = Client::connect(&sock).expect("connect");
        let ns = c.register(&spec("m", LEN as u64)).expect("register").ns;
        let mut put = Vec::new();
        let mut op = 0u64;
        while !done.load(Ordering::Relaxed) {
            if op % 4 == 3 {
                let i = 10_000 + op;
                let st = c.put(ns, &[key(i)], &[&block(i, LEN)]);
                let st = st.unwrap_or_else(|e| panic!("put {i}: the client saw {e}"));
                assert_eq!(st[0], PutStatus::Stored, "put {i}");
                put.push(i);
            } else {
                let i = op % kept;
                let v = c.get(ns, &[key(i)]);
                let v = v.unwrap_or_else(|e| panic!("get {i}: the client saw {e}"));
                let b = v[0].as_ref().expect("a kept block vanished");
                assert!(*b == block(i, LEN), "block {i}: wrong bytes");
            }
            op += 1;
            ops.fetch_add(1, Ordering::Relaxed);
        }
        put
    })
}

#[test]
fn a_client_putting_and_getting_through_a_live_takeover_sees_every_block_with_its_bytes() {
    let sock_dir = temp_dir("takeover-live");
    let sock = sock_dir.join("kvnode.sock");
    let args = ["--dram", "64MiB", "--slab-size", "2MiB", "--no-pin"];
    let a = Daemon::start_at(&sock, &args);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_range(&mut c, ns, 0..64);
    drop(c);
    let (done, ops) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let client = churn(sock.clone(), 64, done.clone(), ops.clone());
    while ops.load(Ordering::Relaxed) < 100 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut with_takeover = args.to_vec();
    with_takeover.push("--takeover");
    // The build is held open 300 ms: the client keeps putting into the donor meanwhile.
    let mut a = a;
    let b = Daemon::spawn_at_env(&sock, &[(PAUSE_ENV, "300")], &with_takeover);
    old_daemon_handed_over(&mut a, &b);
    let before = ops.load(Ordering::Relaxed);
    let t = Instant::now();
    while ops.load(Ordering::Relaxed) < before + 100 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "nothing served after:\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    done.store(true, Ordering::Relaxed);
    let put = client
        .join()
        .expect("the client saw an error, a wrong byte or a lost block");
    assert!(
        b.log().contains("test seam: holding the live build open"),
        "a daemon built with the test seams is needed (see the file's doc); log:\n{}",
        b.log()
    );
    let mut c = Client::connect(&sock).unwrap();
    assert_eq!(c.stats().unwrap().pid, b.child.id());
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    let kept: Vec<u64> = (0..64).collect();
    assert_eq!(intact(&mut c, ns, &kept).len(), 64);
    assert_eq!(
        intact(&mut c, ns, &put).len(),
        put.len(),
        "blocks put during the takeover"
    );
    eprintln!(
        "{} blocks put across the takeover, no error seen",
        put.len()
    );
    drop(c);
    drop(b);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

#[test]
fn blocks_deleted_and_put_while_the_successor_builds_are_as_the_donor_left_them() {
    let sock_dir = temp_dir("takeover-delta");
    let sock = sock_dir.join("kvnode.sock");
    let args = ["--dram", "64MiB", "--slab-size", "2MiB", "--no-pin"];
    let mut a = Daemon::start_at(&sock, &args);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_range(&mut c, ns, 0..32);
    let mut with_takeover = args.to_vec();
    with_takeover.push("--takeover");
    let b = Daemon::spawn_at_env(&sock, &[(PAUSE_ENV, "1500")], &with_takeover);
    // The image is taken (the donor logs it after): change the donor while B builds.
    wait_for(&a, "live image taken", Duration::from_secs(10));
    assert_eq!(c.delete(ns, &[key(3)]).unwrap(), 1);
    // The freed slot is the first a new block takes.
    put_range(&mut c, ns, 500..502);
    assert!(
        !b.log().contains("built the DRAM tier"),
        "the build ended before the changes; log:\n{}",
        b.log()
    );
    drop(c);
    old_daemon_handed_over(&mut a, &b);
    let mut c = Client::connect(&sock).unwrap();
    assert_eq!(c.stats().unwrap().pid, b.child.id());
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    let g = c.get(ns, &[key(3)]).unwrap();
    assert!(
        g[0].is_none(),
        "a block deleted during the build is served again"
    );
    assert_eq!(
        intact(&mut c, ns, &[500, 501]),
        vec![500, 501],
        "log:\n{}",
        b.log()
    );
    let others: Vec<u64> = (0..32).filter(|&i| i != 3).collect();
    assert_eq!(intact(&mut c, ns, &others).len(), 31);
    drop(c);
    drop(b);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

/// The old daemon `a` exited 0 within 30 s of its successor `b`'s spawn (both logs otherwise).
fn old_daemon_handed_over(a: &mut Daemon, b: &Daemon) {
    let st = a.wait_exit(Duration::from_secs(30));
    assert!(
        st.is_some_and(|s| s.success()),
        "{}\nnew:\n{}",
        a.log(),
        b.log()
    );
}
