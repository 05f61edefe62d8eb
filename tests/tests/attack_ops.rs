//! Attacks on the daemon's table of hinted-pull ops (issue 25 item 5). Pins: an op refused
//! before its reply (unauthorized endpoint) is not kept, so `Wait` on it finds nothing and
//! floods of huge refused `Exists{hint}` do not grow the daemon; every key of a refused op
//! carries the refusal's code (`NotAuthorized`, not `NotCovered`) with the message given
//! once as the op's reason; one connection cannot keep more than its cap of keys in
//! running ops (the next is refused `PeerBusy`) while another connection still can.
//! Run: `cargo test --release -p kvnode-e2e --test attack_ops`.

use std::net::TcpListener;

use kvnode_e2e::{Daemon, free_port, hint, key, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::pull::{FailCode, KeyOutcome, OpState};

fn anon_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("RssAnon")
}

fn keys(from: u64, n: u64) -> Vec<Key> {
    (from..from + n).map(key).collect()
}

/// A daemon allowed to pull only from `tcp://127.0.0.1:<allowed>`.
fn dest(allowed: u16, extra: &[&str]) -> Daemon {
    let peers = format!("tcp://127.0.0.1:{allowed}");
    let mut args = vec![
        "--dram",
        "64MiB",
        "--no-pin",
        "--no-populate",
        "--peers",
        &peers,
    ];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

#[test]
fn a_refused_hint_reports_not_authorized_per_key_and_is_not_kept() {
    let (allowed, other) = (free_port(), free_port());
    let d = dest(allowed, &[]);
    let mut c = d.client();
    let ns = c.register(&spec("ops", 4096)).unwrap().ns;
    let ks = keys(0, 8);
    let (_, op) = c.exists_hinted(ns, &ks, Some(&hint(other, &ks))).unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Failed);
    assert_eq!(op.reason.as_ref().unwrap().code, FailCode::NotAuthorized);
    for r in &op.results {
        assert!(
            matches!(r, KeyOutcome::Failed(f) if f.code == FailCode::NotAuthorized),
            "per-key outcome of a refused op: {r:?}"
        );
    }
    // The reply was the op's final report; nothing is kept to wait for.
    let waited = c.wait(op.op, 0);
    assert!(
        waited
            .as_ref()
            .is_err_and(|e| e.to_string().contains("no operation")),
        "a refused op stayed in the table: {waited:?}"
    );
}

#[test]
fn floods_of_huge_refused_hinted_exists_do_not_grow_the_daemon() {
    const KEYS: u64 = 100_000;
    let (allowed, other) = (free_port(), free_port());
    let d = dest(allowed, &[]);
    let ks = keys(0, KEYS);
    let h = hint(other, &ks);
    // One request per connection first, so that the allocator's arenas have grown to what
    // one request needs; then 30 more.
    let warm = std::sync::Barrier::new(4);
    let measured = std::sync::Barrier::new(4);
    let mut before = 0;
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let mut c = d.client();
                let ns = c.register(&spec("ops", 4096)).unwrap().ns;
                for i in 0..11 {
                    let (_, op) = c.exists_hinted(ns, &ks, Some(&h)).unwrap();
                    assert_eq!(op.unwrap().state, OpState::Failed);
                    if i == 0 {
                        warm.wait();
                        measured.wait();
                    }
                }
            });
        }
        warm.wait();
        before = anon_kib(d.child.id());
        measured.wait();
    });
    let grown = anon_kib(d.child.id()).saturating_sub(before);
    // 30 ops of 100 000 keys kept for a minute were ~350 MiB; transient buffers are a few
    // dozen MiB at most.
    assert!(
        grown < 96 << 10,
        "daemon RSS grew by {} MiB after 30 refused ops",
        grown >> 10
    );
}

#[test]
fn one_connection_cannot_keep_more_than_its_cap_of_op_keys() {
    const KEYS: u64 = 50_000;
    // A peer that accepts (the kernel's backlog) and never answers: pulls stay running.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let dir = temp_dir("ops-cap");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        "[peer]\nconnect_timeout_ms = 20000\nmax_outstanding_keys = 4000000\n",
    )
    .unwrap();
    let d = dest(port, &["--config", cfg.to_str().unwrap()]);
    let mut c = d.client();
    let ns = c.register(&spec("ops", 4096)).unwrap().ns;
    let mut refused = None;
    for i in 0..8u64 {
        let ks = keys(i * KEYS, KEYS);
        let op = c
            .pull(ns, &ks, &hint(port, &ks), &[], Some(30_000))
            .unwrap();
        if op.state == OpState::Failed {
            refused = Some((i, op));
            break;
        }
        assert_eq!(op.state, OpState::Pulling, "op {i}: {:?}", op.reason);
    }
    let (i, op) = refused.expect("eight ops of 50 000 keys were all kept");
    assert_eq!(i, 5, "refused after 5 x 50 000 keys (cap 256 Ki)");
    let why = op.reason.unwrap();
    assert_eq!(why.code, FailCode::PeerBusy);
    assert!(
        why.message.contains("this connection already has"),
        "{why:?}"
    );
    // Another connection is not affected.
    let mut c2 = d.client();
    let ks = keys(1 << 30, KEYS);
    let op = c2
        .pull(ns, &ks, &hint(port, &ks), &[], Some(30_000))
        .unwrap();
    assert_eq!(op.state, OpState::Pulling, "{:?}", op.reason);
    drop(silent);
    let _ = std::fs::remove_dir_all(dir);
}
