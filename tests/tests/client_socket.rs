//! The client socket under hostile clients: silent connections are closed after the Hello
//! deadline, descriptors sent with any frame but `AttachRegion` are closed at once, ops belong
//! to the connection that started them, and a regular file at the socket path is never
//! replaced. Real daemons, real sockets.
//! Run: `cargo test --release -p kvnode-e2e --test client_socket`.

use std::os::fd::AsFd;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

use kvnode_e2e::raw::Raw;
use kvnode_e2e::{Daemon, free_port, hint, key, peer_dest, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::client::{ErrorCode, Op, Request};
use kvnode_proto::pull::OpState;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

#[test]
fn a_connection_that_never_says_hello_is_closed_after_the_deadline() {
    let dir = temp_dir("hello");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(&cfg, "hello_timeout_s = 0.3\n").unwrap();
    let d = Daemon::start(&[
        "--dram",
        "64MiB",
        "--no-pin",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    let mut silent: Vec<Raw> = (0..20).map(|_| Raw::connect(&d, false)).collect();
    let t = Instant::now();
    for r in &mut silent {
        let msg = r.expect_error(ErrorCode::Handshake);
        assert!(msg.contains("no Hello within"), "{msg}");
        assert!(r.closed());
    }
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "silent clients held for {took:?}"
    );
    // Everyone else is served throughout.
    d.client().stats().unwrap();
}

#[test]
fn descriptors_sent_with_other_frames_are_closed_at_once() {
    let d = Daemon::start(&["--dram", "64MiB", "--no-pin"]);
    let pid = d.client().daemon_pid();
    let before = open_fds(pid);
    let file = std::fs::File::open("/dev/null").unwrap();
    let mut conns = Vec::new();
    for _ in 0..40 {
        let r = Raw::connect(&d, true);
        for id in 0..8 {
            let f = kvnode_proto::frame::encode_frame(&Request { id, op: Op::Stats }, 0).unwrap();
            kvnode_fdpass::send_with_fd(r.0.as_raw_fd(), &f, file.as_fd()).unwrap();
        }
        conns.push(r);
    }
    // Every Stats is answered; the descriptors that came with them are gone.
    for r in &mut conns {
        for _ in 0..8 {
            assert!(r.recv().is_some());
        }
    }
    let after = open_fds(pid);
    // One socket per connection (plus slack for the runtime); 320 descriptors were sent.
    assert!(
        after <= before + conns.len() + 8,
        "daemon holds {after} descriptors (was {before}) for {} connections",
        conns.len()
    );
}

#[test]
fn an_op_cannot_be_waited_for_or_cancelled_from_another_connection() {
    // A peer that accepts but never answers keeps the op in flight.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let d = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let (mut x, mut y) = (d.client(), d.client());
    let ns = x.register(&spec("m", 4096)).unwrap().ns;
    let keys: Vec<Key> = (0..2).map(key).collect();
    let op = x
        .pull(ns, &keys, &hint(port, &keys), &[], Some(5000))
        .unwrap();
    assert_eq!(op.state, OpState::Pulling, "{op:?}");
    let err = y.cancel(op.op).unwrap_err().to_string();
    assert!(err.contains("belongs to another connection"), "{err}");
    let err = y.wait(op.op, 10).unwrap_err().to_string();
    assert!(err.contains("belongs to another connection"), "{err}");
    // The owner still sees and ends its op.
    let r = x.cancel(op.op).unwrap();
    assert_eq!(r.state, OpState::Cancelled, "{r:?}");
    drop(silent);
    let _ = free_port();
}

#[test]
fn a_regular_file_at_the_socket_path_is_never_replaced() {
    let dir = temp_dir("not-a-socket");
    let path = dir.join("precious.txt");
    std::fs::write(&path, "keep me").unwrap();
    let out = kvnode_e2e::kvnode_cmd()
        .args(["serve", "--dram", "64MiB", "--no-pin", "--socket"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
}
