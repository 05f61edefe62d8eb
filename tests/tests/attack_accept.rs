//! Attacks on the client socket before the handshake (issue 25 item 7). Pins: a uid the
//! allowlist refuses gets its `Error { Handshake }` at accept, at once, not after the
//! `Hello` timeout; one uid cannot hold more than `max_pre_hello_per_uid` connections that
//! have not said `Hello` (the next is refused at once and counted), while connections that
//! complete the handshake do not count; a pre-`Hello` frame header larger than 4 KiB is
//! refused at once instead of being read (no buffer is allocated for it).
//! Run: `cargo test --release -p kvnode-e2e --test attack_accept`.

use std::io::Write;
use std::time::{Duration, Instant};

use kvnode_e2e::raw::Raw;
use kvnode_e2e::{Daemon, temp_dir};
use kvnode_proto::PROTOCOL_VERSION;
use kvnode_proto::client::{ErrorCode, Op, Reply, Request};
use kvnode_proto::frame::FramePrefix;

/// The daemons here wait this long for a `Hello` before they give up on a connection...
const HELLO_TIMEOUT_S: f64 = 120.0;
/// ...so a refusal within this bound came at accept, not from the `Hello` timeout. Wide on
/// purpose: the tests run beside others on a loaded machine, and what they pin is which of
/// the two paths answered, not how fast.
const AT_ONCE: Duration = Duration::from_secs(30);

/// A config file with `text` and the long `Hello` timeout above.
fn config(text: &str) -> String {
    let dir = temp_dir("accept");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        format!("hello_timeout_s = {HELLO_TIMEOUT_S:.1}\n{text}"),
    )
    .unwrap();
    cfg.to_str().unwrap().to_owned()
}

fn quick(r: &Raw) {
    r.0.set_read_timeout(Some(AT_ONCE)).unwrap();
}

fn hello(r: &mut Raw) -> Reply {
    r.send(
        &Request {
            id: 1,
            op: Op::Hello {
                version: PROTOCOL_VERSION,
                client: "attack".into(),
            },
        },
        &[],
    );
    r.recv().expect("an answer to Hello").reply
}

#[test]
fn a_refused_uid_is_answered_at_accept_not_after_the_hello_timeout() {
    // Only uid 64001 may connect; the test (root) is refused.
    let cfg = config("allow_uids = [64001]\n");
    let dir = temp_dir("accept-refused");
    let socket = dir.join("kvnode.sock");
    let d = Daemon::spawn_at(&socket, &["--dram", "64MiB", "--no-pin", "--config", &cfg]);
    let t = Instant::now();
    while !socket.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        let mut r = Raw::connect(&d, false);
        quick(&r);
        let t = Instant::now();
        let msg = r.expect_error(ErrorCode::Handshake);
        assert!(msg.contains("is not allowed to connect"), "{msg}");
        assert!(t.elapsed() < AT_ONCE, "{:?}", t.elapsed());
        assert!(r.closed());
    }
    // A client that sends its Hello first reads the same refusal.
    let mut r = Raw::connect(&d, false);
    quick(&r);
    let reply = hello(&mut r);
    assert!(
        matches!(&reply, Reply::Error { code: ErrorCode::Handshake, message } if message.contains("not allowed")),
        "{reply:?}"
    );
}

#[test]
fn one_uid_cannot_hold_more_than_its_cap_of_connections_before_hello() {
    let cfg = config("max_pre_hello_per_uid = 8\n");
    let d = Daemon::start(&["--dram", "64MiB", "--no-pin", "--config", &cfg]);
    // Clients that have read their HelloOk never count, not even for an instant after it
    // (the daemon frees the slot before it answers): eight of them, kept open, then the
    // eight silent ones fill the cap exactly.
    let _done: Vec<_> = (0..8).map(|_| d.client()).collect();
    let mut silent: Vec<Raw> = (0..8).map(|_| Raw::connect(&d, false)).collect();
    std::thread::sleep(Duration::from_millis(100));
    let mut ninth = Raw::connect(&d, false);
    quick(&ninth);
    let t = Instant::now();
    let msg = ninth.expect_error(ErrorCode::Handshake);
    assert!(msg.contains("have not sent Hello"), "{msg}");
    assert!(t.elapsed() < AT_ONCE, "{:?}", t.elapsed());
    // Completing the handshake frees the slots: the same uid connects again.
    for r in &mut silent {
        quick(r);
        assert!(matches!(hello(r), Reply::HelloOk { .. }));
    }
    let mut c = d.client();
    let s = c.stats().unwrap();
    assert_eq!(s.refused.pre_hello, 1, "{:?}", s.refused);
    assert!(d.log().contains("client refused at accept"));
}

#[test]
fn a_large_header_before_hello_is_refused_at_once() {
    let cfg = config("");
    let d = Daemon::start(&["--dram", "64MiB", "--no-pin", "--config", &cfg]);
    let mut r = Raw::connect(&d, false);
    quick(&r);
    let p = FramePrefix {
        header_len: 1 << 20,
        payload_len: 0,
    };
    r.0.write_all(&p.encode()).unwrap();
    // The daemon may refuse and close on the prefix alone, before these bytes arrive.
    let _ = r.0.write_all(&[0u8; 100]);
    let t = Instant::now();
    let msg = r.expect_error(ErrorCode::Handshake);
    assert!(msg.contains("before Hello"), "{msg}");
    assert!(t.elapsed() < AT_ONCE, "{:?}", t.elapsed());
    assert!(r.closed());
    d.client().stats().unwrap();
}
