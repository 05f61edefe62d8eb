//! The UCX peer transport between real daemons over UCX's TCP transport (`UCX_TLS=tcp` on
//! loopback): what only UCX has. Four more suites run a second time over UCX with
//! `KVNODE_E2E_PEER_TRANSPORT=ucx` (`peer`, `peer_faults`, `peer_bad_frames`, `peer_spill`:
//! byte-identical pulls, SIGSTOP/SIGKILL/restart of the source, the cancel fence, keys), each
//! pull there shown by the UCX counters to have moved by GET; `cargo xtask test` runs both
//! passes (docs/peer-protocol.md, "Which suites run over UCX").
//! Run: `cargo test --release -p kvnode-e2e --test peer_ucx`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvnode_client::kvnode_proto::client::Extent;
use kvnode_e2e::{Daemon, block, free_port, hint, key, spec};
use kvnode_proto::Key;
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{PeerMsg, decode_peer};
use kvnode_proto::pull::{FailCode, KeyOutcome, OpReport, OpState};

const PAGE: usize = 1 << 20;
const UCX: [&str; 3] = kvnode_e2e::UCX_SOFTWARE;

fn tls() -> [(&'static str, &'static str); 1] {
    [("UCX_TLS", "tcp")]
}

fn source(port: u16, extra: &[&str]) -> Daemon {
    let args = kvnode_e2e::peer_source_args(port, extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start_env(&tls(), &refs)
}

fn dest(port: u16, extra: &[&str]) -> Daemon {
    let peers = format!("tcp://127.0.0.1:{port}");
    let mut args = vec!["--dram", "256MiB", "--no-pin", "--peers", &peers];
    args.extend_from_slice(extra);
    Daemon::start_env(&tls(), &args)
}

fn fill(d: &Daemon, keys: &[Key]) -> u32 {
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    for (i, k) in keys.iter().enumerate() {
        c.put(ns, &[*k], &[&block(i as u64, PAGE)]).unwrap();
    }
    ns
}

/// Pulls `keys` from the source on `port` into `d` with a hinted get; the op and the pages.
fn pull(d: &Daemon, port: u16, keys: &[Key]) -> (OpReport, Vec<Option<Vec<u8>>>) {
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let (pages, op) = c
        .get_hinted(ns, keys, Some(&hint(port, keys)), Some(10_000))
        .unwrap();
    (op.unwrap(), pages)
}

/// Pulls `keys` (filled with [`fill`]) by UCX GETs: done, byte-identical, leases released.
fn pulled_whole_by_gets(src: &Daemon, dst: &Daemon, port: u16, keys: &[Key]) {
    let (op, pages) = pull(dst, port, keys);
    assert_eq!(op.state, OpState::Done, "{op:?}");
    for (i, p) in pages.iter().enumerate() {
        assert!(
            p.as_deref() == Some(block(i as u64, PAGE).as_slice()),
            "page {i} differs"
        );
    }
    assert!(
        dst.log().contains("pulling from this peer with UCX GETs"),
        "{}",
        dst.log()
    );
    leases_drain(src);
}

fn leases_drain(d: &Daemon) {
    let t = Instant::now();
    while d.client().stats().unwrap().tiers[0].leases != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "source leases outlive the pull"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
    r
}

/// `stats.peer`'s entry for `name` (the default, all zeros, when absent).
fn peer_stats(d: &Daemon, name: &str) -> kvnode_proto::stats::PeerStats {
    let s = d.client().stats().unwrap();
    s.peer
        .into_iter()
        .find(|p| p.peer == name)
        .unwrap_or_default()
}

/// Pulls `keys` (the first `done` already pulled) after a re-key of the source's arena, and
/// shows by the counters that the rest came by GET on the connection that carried on: each
/// missing block read with a UCX GET, every one a `Slot` served by the source, no fallback.
fn pull_after_rekey_by_gets(src: &Daemon, dst: &Daemon, port: u16, keys: &[Key], done: usize) {
    let name = format!("tcp://127.0.0.1:{port}");
    let (got0, served0) = (peer_stats(dst, &name), slots_served(src));
    let (op, pages) = pull(dst, port, keys);
    assert_pulled_whole(&op, &pages, dst);
    let got = peer_stats(dst, &name);
    let rest = (keys.len() - done) as u64;
    assert_eq!(
        (
            got.peer_ucx_gets_total - got0.peer_ucx_gets_total,
            got.peer_ucx_fallbacks_total,
            slots_served(src) - served0,
        ),
        (rest, 0, rest),
        "the pull after the re-key did not move its {rest} blocks by UCX GET (gets, fallbacks, \
         slots served): before {got0:?}, after {got:?}\n{}",
        dst.log()
    );
}

/// Blocks `d` answered with a UCX `Slot`, over every destination.
fn slots_served(d: &Daemon) -> u64 {
    let s = d.client().stats().unwrap();
    s.peer.iter().map(|p| p.peer_ucx_slots_served_total).sum()
}

#[test]
fn blocks_move_by_ucx_get_byte_identical_and_the_source_releases_its_leases() {
    let port = free_port();
    let src = source(port, &UCX);
    let mport = free_port();
    let metrics = format!("127.0.0.1:{mport}");
    let dst = dest(port, &[&UCX[..], &["--metrics", &metrics]].concat());
    assert!(src.log().contains("transport ucx (UCX 1."), "{}", src.log());
    let keys: Vec<Key> = (0..24).map(key).collect();
    fill(&src, &keys);
    pulled_whole_by_gets(&src, &dst, port, &keys);
    // Every block came by GET, and each daemon counts it per peer (stats and /metrics).
    let name = format!("tcp://127.0.0.1:{port}");
    let got = peer_stats(&dst, &name);
    assert_eq!(
        (got.peer_ucx_gets_total, got.peer_ucx_fallbacks_total),
        (24, 0),
        "{got:?}"
    );
    let served: u64 = src
        .client()
        .stats()
        .unwrap()
        .peer
        .iter()
        .map(|p| p.peer_ucx_slots_served_total)
        .sum();
    assert_eq!(served, 24);
    let m = scrape(mport);
    assert!(
        m.contains(&format!("kvnode_peer_ucx_gets_total{{peer=\"{name}\"}} 24")),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "kvnode_peer_ucx_fallbacks_total{{peer=\"{name}\"}} 0"
        )),
        "{m}"
    );
    assert!(
        m.contains("# TYPE kvnode_peer_ucx_slots_served_total counter"),
        "{m}"
    );
}

#[test]
fn a_block_changed_in_the_source_arena_after_its_checksum_is_refused_and_not_committed() {
    let port = free_port();
    let src = source(port, &UCX);
    let keys: Vec<Key> = (0..3).map(key).collect();
    let ns = fill(&src, &keys);
    // A first pull makes the source hash (and keep the checksum of) every block.
    let first = dest(port, &UCX);
    assert_eq!(pull(&first, port, &keys).0.state, OpState::Done);
    leases_drain(&src);
    // Then a client of the source scribbles on key 1's slot through its arena mapping.
    let mut c = src.client();
    let lease = c.get_lease(ns, &keys[1..2]).unwrap();
    let e: Extent = lease.extents[0].expect("key 1 is held");
    c.arena().write(Extent {
        offset: e.offset + 4096,
        len: 1,
    })[0] ^= 0x5a;
    c.release(lease.id).unwrap();
    let second = dest(port, &UCX);
    let (op, _) = pull(&second, port, &keys);
    assert_eq!(op.state, OpState::Partial, "{op:?}");
    assert!(
        matches!(&op.results[1], KeyOutcome::Failed(r)
            if r.code == FailCode::Checksum && r.message.contains("checksum mismatch")),
        "{op:?}"
    );
    assert_eq!(op.results[0], KeyOutcome::Pulled);
    let mut d = second.client();
    let dns = d.register(&spec("m", PAGE as u64)).unwrap().ns;
    assert_eq!(
        d.exists(dns, &keys[1..2]).unwrap(),
        0,
        "the changed block was committed"
    );
    assert_eq!(d.stats().unwrap().tiers[0].reserved, 0);
}

fn send(s: &mut TcpStream, m: &PeerMsg) {
    s.write_all(&encode_frame(m, 0).unwrap()).unwrap();
}

fn recv(s: &mut TcpStream) -> Option<PeerMsg> {
    let mut p = [0u8; PREFIX_LEN];
    s.read_exact(&mut p).ok()?;
    let prefix = FramePrefix::decode(p).unwrap();
    let mut h = vec![0u8; prefix.header_len as usize];
    s.read_exact(&mut h).ok()?;
    decode_peer(prefix, &h).ok()
}

#[test]
fn ucx_access_is_never_offered_before_authentication_and_wrong_keys_get_nothing() {
    let dir = kvnode_e2e::temp_dir("ucx-keys");
    let (ka, kb) = (dir.join("a.key"), dir.join("b.key"));
    std::fs::write(&ka, "cluster-key-aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    std::fs::write(&kb, "cluster-key-bbbbbbbbbbbbbbbbbbbbbbbb\n").unwrap();
    let port = free_port();
    let src = source(
        port,
        &[
            "--peer-transport",
            "ucx",
            "--peer-ucx-insecure-software-rma",
            "--cluster-key",
            ka.to_str().unwrap(),
        ],
    );
    let keys: Vec<Key> = (0..2).map(key).collect();
    fill(&src, &keys);
    // A raw client asking for UCX as its first frame is refused, with no offer.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    send(&mut s, &PeerMsg::UcxRequest);
    let got = recv(&mut s);
    assert!(matches!(got, Some(PeerMsg::Refused { .. })), "{got:?}");
    assert!(
        recv(&mut s).is_none(),
        "the source kept talking after refusing"
    );
    // A destination with the wrong key is refused at the handshake: nothing pulled.
    let wrong = dest(
        port,
        &[
            "--peer-transport",
            "ucx",
            "--peer-ucx-insecure-software-rma",
            "--cluster-key",
            kb.to_str().unwrap(),
        ],
    );
    let (op, _) = pull(&wrong, port, &keys);
    assert_eq!(op.state, OpState::Failed, "{op:?}");
    assert!(
        matches!(&op.results[0], KeyOutcome::Failed(r) if r.code == FailCode::PeerRefused),
        "{op:?}"
    );
    assert!(!wrong.log().contains("UCX GETs"), "{}", wrong.log());
    // The right key gets UCX.
    let right = dest(
        port,
        &[
            "--peer-transport",
            "ucx",
            "--peer-ucx-insecure-software-rma",
            "--cluster-key",
            ka.to_str().unwrap(),
        ],
    );
    assert_eq!(pull(&right, port, &keys).0.state, OpState::Done);
    assert!(
        right.log().contains("pulling from this peer with UCX GETs"),
        "{}",
        right.log()
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_source_without_ucx_serves_a_ucx_destination_over_tcp() {
    let port = free_port();
    let src = source(port, &[]);
    let dst = dest(port, &UCX);
    let keys: Vec<Key> = (0..4).map(key).collect();
    fill(&src, &keys);
    let (op, pages) = pull(&dst, port, &keys);
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert!(pages[3].as_deref() == Some(block(3, PAGE).as_slice()));
    assert!(
        dst.log().contains("peer declined UCX; pulling over TCP"),
        "{}",
        dst.log()
    );
    let got = peer_stats(&dst, &format!("tcp://127.0.0.1:{port}"));
    assert_eq!(got.peer_ucx_gets_total, 0, "{got:?}");
    assert!(got.peer_ucx_fallbacks_total >= 1, "{got:?}");
}

#[test]
fn auto_falls_back_to_tcp_when_ucx_cannot_start_and_ucx_refuses_to_start() {
    // No transport of this name exists, so UCX finds no resources.
    let bad = [("UCX_TLS", "no_such_transport")];
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let src = Daemon::start_env(
        &bad,
        &[
            "--dram",
            "256MiB",
            "--no-pin",
            "--peer-listen",
            &listen,
            kvnode_e2e::KEYLESS,
            "--peer-transport",
            "auto",
        ],
    );
    assert!(src.log().contains("auto: UCX unavailable"), "{}", src.log());
    let keys: Vec<Key> = (0..2).map(key).collect();
    fill(&src, &keys);
    let dst = dest(port, &["--peer-transport", "auto"]);
    assert_eq!(pull(&dst, port, &keys).0.state, OpState::Done);
    let dir = kvnode_e2e::temp_dir("ucx-refuse");
    let sock = dir.join("k.sock");
    let out = kvnode_e2e::kvnode_cmd()
        .args([
            "serve",
            "--dram",
            "64MiB",
            "--no-pin",
            "--peer-transport",
            "ucx",
            "--socket",
        ])
        .arg(&sock)
        .envs(bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without UCX: {err}");
    assert!(
        err.contains("peer transport ucx") && err.contains("ucx_info"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sigusr2_revokes_the_arena_key_and_open_connections_carry_on_with_the_new_one() {
    let port = free_port();
    let src = source(port, &UCX);
    let dst = dest(port, &UCX);
    let keys: Vec<Key> = (0..8).map(key).collect();
    fill(&src, &keys);
    assert_eq!(pull(&dst, port, &keys[..4]).0.state, OpState::Done);
    src.signal(libc::SIGUSR2);
    let t = Instant::now();
    while !src.log().contains("UCX arena key revoked and re-issued") {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", src.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    pull_after_rekey_by_gets(&src, &dst, port, &keys, 4);
    leases_drain(&src);
}

/// An encrypted session (`--peer-encrypt` on the destination: a session is encrypted when
/// either side asks) is never offered UCX, whose GETs would move the blocks in the clear: the
/// source declines, the pull runs over sealed TCP frames and is byte-identical.
#[test]
fn an_encrypted_session_is_never_offered_ucx_and_pulls_over_tcp() {
    let dir = kvnode_e2e::temp_dir("ucx-encrypt");
    let k = dir.join("cluster.key");
    std::fs::write(&k, "cluster-key-eeeeeeeeeeeeeeeeeeeeeeee\n").unwrap();
    let port = free_port();
    let src = source(
        port,
        &[UCX[0], UCX[1], UCX[2], "--cluster-key", k.to_str().unwrap()],
    );
    assert!(src.log().contains("transport ucx (UCX 1."), "{}", src.log());
    let keys: Vec<Key> = (0..3).map(key).collect();
    fill(&src, &keys);
    let dst = dest(
        port,
        &[
            UCX[0],
            UCX[1],
            UCX[2],
            "--cluster-key",
            k.to_str().unwrap(),
            "--peer-encrypt",
        ],
    );
    let (op, pages) = pull(&dst, port, &keys);
    assert_pulled_whole(&op, &pages, &dst);
    let log = dst.log();
    // An encrypting destination does not even ask for UCX (a source asked by a plain one
    // declines: source.rs), so neither an offer nor a GET happens.
    assert!(
        !log.contains("pulling from this peer with UCX GETs"),
        "{log}"
    );
    // With the per-peer UCX counters in stats (`peer` section), none moved.
    let stats = kvnode_e2e::peerstats::stats_json(&dst.socket);
    // (No entry at all also means no GET: the counters exist only for peers it talked to.)
    let gets = kvnode_e2e::peerstats::peer_counter(&stats, "peer_ucx_gets_total").unwrap_or(0);
    assert_eq!(gets, 0, "an encrypted session used UCX GETs: {stats:#}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The reverse case: the source asks for encryption (`--peer-encrypt`), the destination does
/// not, so the session is encrypted and only the source knows to keep UCX out. The plain
/// destination asks for UCX; the source declines (its guard in peer/source), the destination
/// counts a fallback and pulls over sealed TCP frames, byte-identical, with no GET and no
/// `Slot` served.
#[test]
fn an_encrypting_source_declines_ucx_to_a_plain_destination_and_serves_over_tcp() {
    let dir = kvnode_e2e::temp_dir("ucx-encrypt-src");
    let k = dir.join("cluster.key");
    std::fs::write(&k, "cluster-key-ssssssssssssssssssssssss\n").unwrap();
    let keyed = [UCX[0], UCX[1], UCX[2], "--cluster-key", k.to_str().unwrap()];
    let port = free_port();
    let src = source(port, &[&keyed[..], &["--peer-encrypt"]].concat());
    assert!(src.log().contains("transport ucx (UCX 1."), "{}", src.log());
    let keys: Vec<Key> = (0..3).map(key).collect();
    fill(&src, &keys);
    let dst = dest(port, &keyed);
    let (op, pages) = pull(&dst, port, &keys);
    assert_pulled_whole(&op, &pages, &dst);
    let got = peer_stats(&dst, &format!("tcp://127.0.0.1:{port}"));
    assert_eq!(
        got.peer_ucx_gets_total, 0,
        "an encrypted session moved blocks by UCX GET, in the clear: {got:?}"
    );
    assert!(
        got.peer_ucx_fallbacks_total >= 1,
        "the plain destination asked for UCX and must have been declined: {got:?}"
    );
    assert_eq!(slots_served(&src), 0, "the encrypting source served a Slot");
    let _ = std::fs::remove_dir_all(dir);
}

/// A cluster-key reload (SIGHUP: key rotation or member removal) also re-issues the UCX arena
/// key, so a removed member's old remote key reads nothing; the destination's open UCX
/// connection is handed the new key and its next pull completes byte-identical over UCX.
#[test]
fn sighup_reloads_the_keys_and_re_issues_the_ucx_arena_key() {
    let dir = kvnode_e2e::temp_dir("ucx-sighup");
    let k = dir.join("cluster.key");
    std::fs::write(&k, "cluster-key-hhhhhhhhhhhhhhhhhhhhhhhh\n").unwrap();
    let port = free_port();
    let key_args = ["--cluster-key", k.to_str().unwrap()];
    let src = source(port, &[UCX[0], UCX[1], UCX[2], key_args[0], key_args[1]]);
    let dst = dest(port, &[UCX[0], UCX[1], UCX[2], key_args[0], key_args[1]]);
    let keys: Vec<Key> = (0..8).map(key).collect();
    fill(&src, &keys);
    assert_eq!(pull(&dst, port, &keys[..4]).0.state, OpState::Done);
    src.signal(libc::SIGHUP);
    let t = Instant::now();
    while !src.log().contains("UCX arena key re-issued (generation") {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", src.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    pull_after_rekey_by_gets(&src, &dst, port, &keys, 4);
    leases_drain(&src);
    let _ = std::fs::remove_dir_all(dir);
}

/// In a keyed session the source's `Slot`s carry the block MAC and the destination checks each
/// landed GET against it (one fast pass instead of BLAKE3): a block changed at the source after
/// it was summed, by a client writing through its arena mapping, is refused by that check and
/// not committed; the other keys land byte-identical.
#[test]
fn a_keyed_ucx_pull_checks_every_get_against_the_block_mac_of_its_slot() {
    let dir = kvnode_e2e::temp_dir("ucx-mac");
    let k = dir.join("cluster.key");
    std::fs::write(&k, "cluster-key-for-the-ucx-block-mac-test\n").unwrap();
    let port = free_port();
    let keyed = [
        "--peer-transport",
        "ucx",
        "--peer-ucx-insecure-software-rma",
        "--cluster-key",
        k.to_str().unwrap(),
    ];
    let src = source(port, &keyed);
    let dst = dest(port, &keyed);
    let keys: Vec<Key> = (0..4).map(key).collect();
    let sns = fill(&src, &keys);
    pulled_whole_by_gets(&src, &dst, port, &keys);
    // Key 1's bytes change at the source after its hash and tag were cached.
    let mut c = src.client();
    let lease = c.get_lease(sns, &keys[1..2]).unwrap();
    let e = lease.extents[0].expect("key 1 is held");
    c.arena().write(e)[PAGE / 2] ^= 0xff;
    c.release(lease.id).unwrap();
    let mut d = dst.client();
    let ns = d.register(&spec("m", PAGE as u64)).unwrap().ns;
    d.delete(ns, &keys).unwrap();
    let (op, pages) = pull(&dst, port, &keys);
    let want = kvnode_e2e::keyed_check();
    assert!(
        matches!(&op.results[1], KeyOutcome::Failed(f) if f.message.contains(want)),
        "the changed block must fail with {want:?}: {op:?}"
    );
    assert_eq!(op.results[0], KeyOutcome::Pulled, "{op:?}");
    assert_eq!(pages[0].as_deref(), Some(block(0, PAGE).as_slice()));
    assert!(
        d.get(ns, &keys[1..2]).unwrap()[0].is_none(),
        "the changed block was committed"
    );
}

/// The op ended `Done` and every page is its block's bytes.
fn assert_pulled_whole(op: &OpReport, pages: &[Option<Vec<u8>>], dst: &Daemon) {
    assert_eq!(op.state, OpState::Done, "{op:?}\n{}", dst.log());
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, PAGE).as_slice()),
            "page {i}"
        );
    }
}
