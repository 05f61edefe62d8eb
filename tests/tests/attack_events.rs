//! Attacks on KV events (issue 38 items 3 and 4), against real daemons and a real ZMQ SUB
//! and DEALER (`event_spy`, decoding with Dynamo's parser).
//!
//! Pins: under a tenant map a uid refused at the client socket cannot read tenant A's
//! prompt token ids or salt from the events, live or by replay (the events sockets are
//! `ipc://` files of mode 0600; tcp needs an explicit switch and is refused without it);
//! and a put / delete flood whose blocks carry 16 Ki-token metadata, from a tenant with an
//! 8 MiB DRAM quota, keeps the daemon's memory flat with and without a replay endpoint:
//! the replay ring stays within its byte bound and the tenant's share, its evictions and
//! the queue's drops are counted (`stats`, `/metrics`).
//!
//! The build under test is asked (`kvnode serve --help`) whether it has private event
//! sockets. One without them (894818a) offers only tcp, so the attacks run against that,
//! the only deployment it has; they fail there for the reason their names give.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_events`.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::{Daemon, free_port, key, kvnode_bin, not_root, prerequisite, spec, temp_dir};
use kvnode_proto::client::BlockMeta;

const UID_A: u32 = 64001;
const UID_B: u32 = 64002;

/// Whether the daemon under test has `ipc://` event sockets (and the per-tenant switch).
fn private_events() -> bool {
    let out = Command::new(kvnode_bin())
        .args(["serve", "--help"])
        .output()
        .expect("kvnode serve --help");
    let has = String::from_utf8_lossy(&out.stdout).contains("--events-tcp-readable-by-anyone");
    if !has {
        eprintln!("!!! this kvnode has no private event sockets: attacking its tcp events");
    }
    has
}

/// Events and replay endpoints: ipc files in a private directory, or (an old build)
/// loopback tcp ports.
fn endpoints(private: bool) -> (String, String) {
    if private {
        let d = temp_dir("events-sockets");
        let ep = |f: &str| format!("ipc://{}", d.join(f).display());
        (ep("ev.sock"), ep("replay.sock"))
    } else {
        let ep = || format!("tcp://127.0.0.1:{}", free_port());
        (ep(), ep())
    }
}

/// A daemon with `tenant_a` lines for tenant `a` (uid `a_uid`), this process (root) in
/// tenant `ops` when it is not `a`, unmapped uids refused, a socket every uid may open, and events (with
/// replay when `replay`).
fn daemon(a_uid: u32, tenant_a: &str, replay: bool, extra: &[&str]) -> (Daemon, String, String) {
    let private = private_events();
    let (events, replay_ep) = endpoints(private);
    let dir = temp_dir("events-cfg");
    let cfg = dir.join("kvnode.toml");
    let publish = if private {
        "publish_events = true\n"
    } else {
        ""
    };
    // SAFETY: geteuid has no preconditions.
    let ops = if a_uid == unsafe { libc::geteuid() } {
        ""
    } else {
        "[[tenants.tenant]]\nname = \"ops\"\nuids = [0]\n"
    };
    std::fs::write(
        &cfg,
        format!(
            "socket_mode = 0o666\n[tenants]\nunmapped = \"refuse\"\n{ops}\
             [[tenants.tenant]]\nname = \"a\"\nuids = [{a_uid}]\n{publish}{tenant_a}\n"
        ),
    )
    .unwrap();
    let mut args = vec![
        "--no-pin",
        "--no-populate",
        "--dram",
        "64MiB",
        "--config",
        cfg.to_str().unwrap(),
        "--events",
        &events,
    ];
    if replay {
        args.extend(["--events-replay", &replay_ep]);
    }
    args.extend_from_slice(extra);
    (Daemon::start(&args), events, replay_ep)
}

fn run_as(uid: u32, bin: &str, args: &[&str]) -> HashMap<String, String> {
    let out = Command::new(bin)
        .args(args)
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap_or_else(|e| panic!("run {bin}: {e}"));
    assert!(
        out.status.success(),
        "{bin} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    kvnode_e2e::key_values(&out.stdout)
}

fn get<'a>(m: &'a HashMap<String, String>, k: &str) -> &'a str {
    m.get(k)
        .map_or_else(|| panic!("no {k} in {m:?}"), String::as_str)
}

/// Tenant A puts a 3-block chain with token metadata under a fresh salt (new blocks, so new
/// stores to announce).
fn a_puts(socket: &Path, salt: &str) {
    let p = run_as(
        UID_A,
        env!("CARGO_BIN_EXE_tenant_probe"),
        &[socket.to_str().unwrap(), "put_meta", salt, "3"],
    );
    assert_eq!(get(&p, "stored"), "3", "tenant A's put: {p:?}");
}

/// Runs `event_spy` as `uid` for 1.5 s while tenant A keeps putting new chains (one before
/// the spy starts, so the replay ring holds A's blocks too).
fn spy_while_a_puts(
    uid: u32,
    socket: &Path,
    events: &str,
    replay: &str,
) -> HashMap<String, String> {
    a_puts(socket, &format!("first-{uid}"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, sock) = (std::sync::Arc::clone(&stop), socket.to_owned());
    let putter = std::thread::spawn(move || {
        let mut n = 0u32;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            a_puts(&sock, &format!("s{n}-{uid}"));
            n += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        n
    });
    let seen = run_as(
        uid,
        env!("CARGO_BIN_EXE_event_spy"),
        &[events, replay, "1500"],
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    putter.join().expect("tenant A's puts");
    seen
}

#[test]
fn a_uid_refused_at_the_socket_cannot_read_tenant_a_tokens_live_or_by_replay() {
    if !prerequisite(
        "root",
        not_root("the test runs clients as uids 64001 and 64002"),
    ) {
        return;
    }
    let (d, events, replay) = daemon(UID_A, "", true, &[]);
    let b = run_as(
        UID_B,
        env!("CARGO_BIN_EXE_tenant_probe"),
        &[d.socket.to_str().unwrap(), "connect"],
    );
    assert!(
        b.contains_key("connect_error"),
        "B is refused at the client socket: {b:?}"
    );
    // The router's view (the daemon's own uid): A's stores are published, with A's salt.
    let router = spy_while_a_puts(0, &d.socket, &events, &replay);
    assert_eq!(get(&router, "sub"), "connected", "{router:?}");
    assert!(
        get(&router, "stored_tokens") != "0",
        "no events flowed: {router:?}"
    );
    assert!(
        get(&router, "salts").contains("kvnode-tenant:a/"),
        "{router:?}"
    );
    assert_ne!(
        get(&router, "snapshot_batches"),
        "0",
        "the router's snapshot request is answered: {router:?}"
    );
    // The attacker's view: nothing of A's, live or replayed.
    let spy = spy_while_a_puts(UID_B, &d.socket, &events, &replay);
    assert_eq!(
        get(&spy, "stored_tokens"),
        "0",
        "uid {UID_B}, refused at the client socket, read tenant A's prompt token ids: {spy:?}"
    );
    assert!(
        !get(&spy, "salts").contains("kvnode-tenant:a"),
        "uid {UID_B} read tenant A's salt: {spy:?}"
    );
    assert_eq!(
        (
            get(&spy, "live_batches"),
            get(&spy, "replay_batches"),
            get(&spy, "snapshot_batches")
        ),
        ("0", "0", "0"),
        "{spy:?}"
    );
}

#[test]
fn tcp_events_are_refused_at_start_unless_the_network_is_declared_trusted() {
    let tcp = format!("tcp://127.0.0.1:{}", free_port());
    let (st, log) = Daemon::start_failing(
        &["--no-pin", "--dram", "64MiB", "--events", &tcp],
        Duration::from_secs(10),
    );
    assert!(!st.success());
    assert!(
        log.contains("tcp_readable_by_anyone") && log.contains("ipc://PATH"),
        "{log}"
    );
    let d = Daemon::start(&[
        "--no-pin",
        "--dram",
        "64MiB",
        "--events",
        &tcp,
        "--events-tcp-readable-by-anyone",
    ]);
    assert!(
        d.log().contains("KV EVENTS ON TCP ARE READABLE BY ANYONE"),
        "{}",
        d.log()
    );
}

/// Resident set and anonymous memory of `pid`, in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {s}"))
    };
    (field("VmRSS:"), field("RssAnon:"))
}

const PAGE: u32 = 16 << 10;
const RING_BYTES: u64 = 4 << 20;

/// Tenant A (this process; 8 MiB DRAM quota) puts 64 blocks carrying 16 Ki-token
/// metadata and deletes them, for `secs`; returns the most VmRSS grew (KiB) and the most
/// the replay ring held, read from `stats` as it went.
fn flood(d: &Daemon, secs: u64) -> (u64, u64) {
    let mut c = d.client();
    let mut s = spec("events-flood", 4096);
    s.page_size = PAGE;
    let ns = c.register(&s).unwrap().ns;
    let keys: Vec<_> = (0..64).map(key).collect();
    let b = vec![5u8; 4096];
    let blocks: Vec<&[u8]> = keys.iter().map(|_| b.as_slice()).collect();
    // Large token values: five msgpack bytes each on the wire.
    let tokens: Vec<u32> = (0..PAGE).map(|i| 0xF000_0000 | i).collect();
    let pid = d.child.id();
    let (base, _) = rss_kib(pid);
    let (mut grown, mut ring_max) = (0u64, 0u64);
    let t = Instant::now();
    let mut round = 0u64;
    while t.elapsed() < Duration::from_secs(secs) {
        let metas = keys
            .iter()
            .map(|_| {
                Some(BlockMeta {
                    tokens: tokens.clone(),
                    parent: None,
                })
            })
            .collect();
        c.put_with_meta(ns, &keys, &blocks, metas).unwrap();
        c.delete(ns, &keys).unwrap();
        round += 1;
        if round.is_multiple_of(8) {
            grown = grown.max(rss_kib(pid).0.saturating_sub(base));
            if let Some(e) = c.stats().unwrap().events {
                ring_max = ring_max.max(e.replay_ring_bytes);
            }
        }
    }
    eprintln!(
        "{round} put/delete rounds in {secs} s; VmRSS grew by up to {} MiB",
        grown >> 10
    );
    (grown, ring_max)
}

fn flood_daemon(replay: bool) -> Daemon {
    let ring = if private_events() {
        format!("[events]\nreplay_ring_bytes = {RING_BYTES}\n")
    } else {
        String::new()
    };
    // Tenant A is this process's uid, with the quota of the attacker.
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let (d, _, _) = daemon(me, &format!("dram_quota = \"8MiB\"\n{ring}"), replay, &[]);
    d
}

/// What the flood may grow the daemon by: the queue's and the ring's bounds are far below.
const GROWTH_LIMIT_KIB: u64 = 96 << 10;

#[test]
fn a_metadata_flood_with_replay_keeps_memory_and_the_ring_bounded() {
    let d = flood_daemon(true);
    let (grown, ring_max) = flood(&d, 10);
    assert!(
        grown < GROWTH_LIMIT_KIB,
        "the daemon's VmRSS grew by {} MiB under an 8 MiB tenant's event flood",
        grown >> 10
    );
    let e = d.client().stats().unwrap().events.expect("events stats");
    assert!(
        ring_max <= RING_BYTES,
        "ring held {ring_max} bytes > {RING_BYTES}"
    );
    assert!(e.replay_ring_bytes <= RING_BYTES, "{e:?}");
    let a = e
        .tenants
        .iter()
        .find(|t| t.name == "a")
        .expect("tenant a's row");
    assert!(
        a.replay_ring_bytes <= a.limit_bytes && a.limit_bytes == (8 << 20) / 16,
        "{a:?}"
    );
    assert!(e.replay_ring_evicted > 0, "evictions counted: {e:?}");
    eprintln!(
        "published {} dropped queue_full {} tenant_budget {} evicted {}",
        e.published, e.dropped_queue_full, e.dropped_tenant_budget, e.replay_ring_evicted
    );
}

#[test]
fn a_metadata_flood_without_replay_keeps_memory_bounded_and_no_ring() {
    let d = flood_daemon(false);
    let (grown, ring_max) = flood(&d, 10);
    assert!(
        grown < GROWTH_LIMIT_KIB,
        "the daemon's VmRSS grew by {} MiB under an 8 MiB tenant's event flood (no replay endpoint)",
        grown >> 10
    );
    let e = d.client().stats().unwrap().events.expect("events stats");
    assert_eq!(
        (ring_max, e.replay_ring_bytes, e.replay_ring_batches),
        (0, 0, 0),
        "{e:?}"
    );
    assert!(e.published > 0, "{e:?}");
}
