//! The peer channel against an attacker without the cluster key (tests/src/bin/peer-attacker,
//! a separate process speaking frames through kvnode-proto): relays in both directions, a
//! reflected proof, a forged proof, a keyless source, an on-path proxy that alters, drops,
//! reorders or replays frames; key rotation, encryption, cross-namespace pulls, the per-peer
//! cap on keys in flight and self-hints by another local address. Real daemons throughout.
//! Run: `cargo test --release -p kvnode-e2e --test peer_attack`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvnode_e2e::keyed_check;
use kvnode_e2e::{Daemon, block, free_port, hint, key, peer_dest, peer_source, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::pull::{FailCode, KeyOutcome, OpReport, OpState};

const PAGE: usize = 64 << 10;

fn attacker(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_peer-attacker"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn peer-attacker")
}

/// Waits for the attacker's `listening` line.
fn listening(c: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut r = BufReader::new(c.stdout.take().expect("stdout"));
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "listening");
    r
}

/// The attacker's report after it exits.
fn report(mut c: Child, r: Option<BufReader<std::process::ChildStdout>>) -> String {
    let mut r = r.unwrap_or_else(|| BufReader::new(c.stdout.take().unwrap()));
    let mut out = String::new();
    std::io::Read::read_to_string(&mut r, &mut out).unwrap();
    assert!(c.wait().unwrap().success(), "attacker failed: {out}");
    out
}

fn key_file(dir: &Path, name: &str, lines: &[&str]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

const OLD: &str = "cluster-key-old-aaaaaaaaaaaaaaaaaaaa";
const NEW: &str = "cluster-key-new-bbbbbbbbbbbbbbbbbbbb";

/// Puts `keys` into `d` (namespace "m"); returns their bytes.
fn fill(d: &Daemon, keys: &[Key]) -> Vec<Vec<u8>> {
    fill_pages(d, keys, PAGE)
}

/// Puts one `page`-byte block per key in namespace `m` of that page size.
fn fill_pages(d: &Daemon, keys: &[Key], page: usize) -> Vec<Vec<u8>> {
    let mut c = d.client();
    let ns = c.register(&spec("m", page as u64)).unwrap().ns;
    let data: Vec<Vec<u8>> = (0..keys.len() as u64).map(|i| block(i, page)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, keys, &refs).unwrap();
    data
}

/// A hinted get on `dst` naming `tcp://127.0.0.1:port`, in namespace `model` (of `want`'s
/// page size). Checks that exactly the `Pulled` keys were committed, byte-identical to
/// `want`, and that no reservation leaked.
fn pull(dst: &Daemon, port: u16, keys: &[Key], model: &str, want: &[Vec<u8>]) -> OpReport {
    let mut c = dst.client();
    let page = want.first().map_or(PAGE, Vec::len);
    let ns = c.register(&spec(model, page as u64)).unwrap().ns;
    let (_, op) = c
        .get_hinted(ns, keys, Some(&hint(port, keys)), Some(4000))
        .unwrap();
    let op = op.unwrap();
    let got = c.get(ns, keys).unwrap();
    for (i, (g, r)) in got.iter().zip(&op.results).enumerate() {
        match r {
            KeyOutcome::Pulled | KeyOutcome::HitLocal => {
                assert_eq!(g.as_deref(), Some(want[i].as_slice()), "key {i}: {op:?}");
            }
            _ => assert!(g.is_none(), "key {i} committed though {r:?}"),
        }
    }
    assert_eq!(c.stats().unwrap().tiers[0].reserved, 0, "{op:?}");
    op
}

fn failed_with(r: &KeyOutcome, want: &str) -> bool {
    matches!(r, KeyOutcome::Failed(f) if f.message.contains(want))
}

fn nothing_committed(op: &OpReport) {
    assert!(
        op.results
            .iter()
            .all(|r| matches!(r, KeyOutcome::Failed(_))),
        "{op:?}"
    );
}

#[test]
fn a_keyless_relay_between_keyed_daemons_is_refused_both_ways_and_reads_nothing() {
    let dir = temp_dir("relay");
    let k = key_file(&dir, "k", &[OLD]);
    let k = k.to_str().unwrap();
    let port = free_port();
    let src = peer_source(port, &["--cluster-key", k]);
    let keys: Vec<Key> = (0..3).map(key).collect();
    let data = fill(&src, &keys);
    let dst = peer_dest("127.0.0.0/8", &["--cluster-key", k]);
    let a = format!("127.0.0.1:{port}");
    let a_ep = format!("tcp://{a}");
    // The relay passes the Hello on unchanged (it names the relay), or rewritten to name A.
    for rewrite in [None, Some(a_ep.as_str())] {
        let mport = free_port();
        let listen = format!("127.0.0.1:{mport}");
        let mut args = vec!["relay", listen.as_str(), a.as_str()];
        args.extend(rewrite);
        let mut m = attacker(&args);
        let out = listening(&mut m);
        let op = pull(&dst, mport, &keys, "m", &data);
        let seen = report(m, Some(out));
        nothing_committed(&op);
        let why = match &op.results[0] {
            KeyOutcome::Failed(f) => f.clone(),
            r => panic!("{r:?}"),
        };
        assert_eq!(why.code, FailCode::PeerRefused, "{why:?}");
        if rewrite.is_none() {
            // A refuses a Hello that dialled someone else, before any proof.
            assert!(
                seen.contains("source_answer=Refused(peer authentication failed: the peer dialled"),
                "{seen}"
            );
            assert!(why.message.contains("not this daemon"), "{why:?}");
        } else {
            // A's proof names A; B dialled the relay, so the proof fails at B.
            assert!(seen.contains("source_answer=Challenge"), "{seen}");
            assert!(why.message.contains("a relay?"), "{why:?}");
        }
        // B never sent its proof, and the relay got nothing out of A.
        assert!(!seen.contains("destination_after_challenge=Auth"), "{seen}");
        assert!(seen.contains("blocks_from_source=0"), "{seen}");
        assert!(!seen.contains("source_after_auth=sealed"), "{seen}");
    }
    wait_log(&src, "peer refused");
    // A serves B directly as before.
    let op = pull(&dst, port, &keys, "m", &data);
    assert_eq!(op.state, OpState::Done, "{op:?}");
}

#[test]
fn a_proof_reflected_back_to_the_daemon_that_asked_is_refused() {
    let dir = temp_dir("reflect");
    let k = key_file(&dir, "k", &[OLD]);
    let k = k.to_str().unwrap();
    // B both pulls and serves; the attacker relays B's dial back to B's own listener.
    let bport = free_port();
    let b = peer_source(bport, &["--cluster-key", k, "--peers", "127.0.0.0/8"]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, PAGE)).collect();
    let b_ep = format!("tcp://127.0.0.1:{bport}");
    let mport = free_port();
    let listen = format!("127.0.0.1:{mport}");
    let to = format!("127.0.0.1:{bport}");
    let mut m = attacker(&["relay", &listen, &to, &b_ep]);
    let out = listening(&mut m);
    let op = pull(&b, mport, &keys, "m", &data);
    let seen = report(m, Some(out));
    nothing_committed(&op);
    assert!(seen.contains("source_answer=Challenge"), "{seen}");
    assert!(!seen.contains("destination_after_challenge=Auth"), "{seen}");
    assert!(
        failed_with(&op.results[0], "failed the cluster-key proof"),
        "{op:?}"
    );
}

#[test]
fn a_forged_proof_to_a_keyed_source_is_refused_and_reads_nothing() {
    let dir = temp_dir("forge");
    let k = key_file(&dir, "k", &[OLD]);
    let port = free_port();
    let src = peer_source(port, &["--cluster-key", k.to_str().unwrap()]);
    fill(&src, &(0..2).map(key).collect::<Vec<_>>());
    // Key ids are public (fingerprints); the attacker has the id, not the key.
    let id = kvnode_engine::peer::ClusterKey::from_bytes(OLD.as_bytes()).id();
    let to = format!("127.0.0.1:{port}");
    let seen = report(
        attacker(&["forge", &to, &format!("tcp://{to}"), &format!("{id:016x}")]),
        None,
    );
    assert!(seen.contains("source_answer=Challenge"), "{seen}");
    assert!(
        seen.contains("source_after_auth=Refused(peer authentication failed: the peer failed the cluster-key proof"),
        "{seen}"
    );
    assert!(seen.contains("blocks_from_source=0"), "{seen}");
    wait_log(&src, "peer refused");
}

#[test]
fn a_keyed_destination_refuses_a_keyless_source() {
    let dir = temp_dir("keyless-src");
    let k = key_file(&dir, "k", &[OLD]);
    let port = free_port();
    let src = peer_source(port, &[]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let data = fill(&src, &keys);
    let dst = peer_dest("127.0.0.0/8", &["--cluster-key", k.to_str().unwrap()]);
    let op = pull(&dst, port, &keys, "m", &data);
    nothing_committed(&op);
    assert!(
        matches!(&op.results[0], KeyOutcome::Failed(f)
            if f.code == FailCode::PeerRefused && f.message.contains("no cluster key")),
        "{op:?}"
    );
}

/// Source A (4 blocks), destination B, and an on-path proxy between them.
struct Proxied {
    src: Daemon,
    dst: Daemon,
    proxy: Child,
    port: u16,
    keys: Vec<Key>,
    data: Vec<Vec<u8>>,
    /// What the source sent, as the proxy saw it (mode `pass` only).
    wire: PathBuf,
}

impl Drop for Proxied {
    fn drop(&mut self) {
        let _ = self.proxy.kill();
        let _ = self.proxy.wait();
    }
}

/// Source A listens on one port and advertises the proxy's, so B dials A's name through an
/// on-path proxy (as behind a port forward).
fn through_proxy(mode: &str, extra: &[&str]) -> Proxied {
    through_proxy_pages(mode, extra, PAGE)
}

/// [`through_proxy`] with blocks of `page` bytes.
fn through_proxy_pages(mode: &str, extra: &[&str], page: usize) -> Proxied {
    proxied(mode, extra, page, true)
}

/// [`through_proxy_pages`], with both daemons holding the cluster key or neither (loopback).
fn proxied(mode: &str, extra: &[&str], page: usize, keyed: bool) -> Proxied {
    proxied_keys(mode, extra, page, keyed, 4)
}

/// [`proxied`] with `n` blocks on the source.
fn proxied_keys(mode: &str, extra: &[&str], page: usize, keyed: bool, n: u64) -> Proxied {
    let dir = temp_dir("proxy");
    let k = key_file(&dir, "k", &[OLD]);
    let k = k.to_str().unwrap().to_owned();
    let key_args: Vec<&str> = if keyed {
        vec!["--cluster-key", k.as_str()]
    } else {
        vec![kvnode_e2e::KEYLESS]
    };
    let (aport, pport) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{aport}");
    let adv = format!("tcp://127.0.0.1:{pport}");
    let mut sargs = vec![
        "--dram",
        "256MiB",
        "--no-pin",
        "--peer-listen",
        &listen,
        "--advertise",
        &adv,
    ];
    sargs.extend_from_slice(&key_args);
    let src = Daemon::start(&sargs);
    let keys: Vec<Key> = (0..n).map(key).collect();
    let data = fill_pages(&src, &keys, page);
    let mut dargs = key_args.clone();
    dargs.extend_from_slice(&["--peer-connections", "1"]);
    dargs.extend_from_slice(extra);
    let dst = peer_dest("127.0.0.0/8", &dargs);
    let plisten = format!("127.0.0.1:{pport}");
    let wire = dir.join("wire");
    let wire_s = wire.to_str().unwrap().to_owned();
    let mut args = vec!["proxy", plisten.as_str(), listen.as_str(), mode];
    if mode == "pass" {
        args.push(&wire_s);
    }
    let mut proxy = attacker(&args);
    let _ = listening(&mut proxy);
    Proxied {
        src,
        dst,
        proxy,
        port: pport,
        keys,
        data,
        wire,
    }
}

#[test]
fn an_on_path_proxy_that_alters_drops_reorders_or_replays_a_frame_is_detected() {
    for (mode, want) in [
        ("flip-payload", keyed_check()),
        ("flip-header", "integrity check failed"),
        ("drop", "integrity check failed"),
        ("swap", "integrity check failed"),
        ("replay", "integrity check failed"),
    ] {
        let x = through_proxy(mode, &[]);
        let op = pull(&x.dst, x.port, &x.keys, "m", &x.data);
        assert!(failed_with(&op.results[0], want), "{mode}: {op:?}");
        if mode == "flip-payload" {
            // Only the altered block fails; the connection stays in step.
            assert_eq!(
                op.results[1..],
                vec![KeyOutcome::Pulled; 3],
                "{mode}: {op:?}"
            );
        } else {
            nothing_committed(&op);
        }
        // The source keeps serving: the next pull completes byte-identical.
        pulls_again_whole(&x, mode);
        assert!(x.src.client().stats().is_ok());
    }
}

/// A flipped byte in the last piece of a 1 MiB block is caught before commit, whichever
/// check the session uses: the block MAC as the pieces land (keyed), or BLAKE3 hashed by a
/// helper thread while they are received (keyless: peer/fetch/hash_ahead.rs). Only that
/// block fails, and the connection stays in step for the rest and the next pull.
#[test]
fn a_flipped_byte_in_a_large_block_hashed_while_received_is_caught_before_commit() {
    for (keyed, want) in [(true, keyed_check()), (false, "checksum mismatch (BLAKE3)")] {
        let x = proxied("flip-payload", &[], 1 << 20, keyed);
        let op = pull(&x.dst, x.port, &x.keys, "m", &x.data);
        assert!(failed_with(&op.results[0], want), "keyed {keyed}: {op:?}");
        assert_eq!(op.results[1..], vec![KeyOutcome::Pulled; 3], "{op:?}");
        pulls_again_whole(&x, "flip-payload, 1 MiB");
    }
}

/// The next pull through the same proxy gets every key, byte-identical (`pull` checks bytes).
fn pulls_again_whole(x: &Proxied, what: &str) {
    let again = pull(&x.dst, x.port, &x.keys, "m", &x.data);
    assert!(
        again
            .results
            .iter()
            .all(|r| matches!(r, KeyOutcome::Pulled | KeyOutcome::HitLocal)),
        "{what}: {again:?}"
    );
}

/// The other direction: a proxy that alters the destination's first sealed request on its way
/// to the source. The source's integrity check refuses it (it serves nothing on that
/// session); the pull commits nothing it was not sent whole, and the next pull completes.
#[test]
fn an_on_path_proxy_that_alters_a_frame_from_the_destination_is_detected_by_the_source() {
    let x = through_proxy("flip-header-up", &[]);
    let op = pull(&x.dst, x.port, &x.keys, "m", &x.data);
    // The source sends its refusal before its log line is written: wait for the line.
    wait_log(&x.src, "integrity check failed");
    assert!(
        op.results
            .iter()
            .all(|r| matches!(r, KeyOutcome::Failed(_))),
        "a pull over the tampered session succeeded: {op:?}"
    );
    pulls_again_whole(&x, "flip-header-up");
    assert!(x.src.client().stats().is_ok());
}

#[test]
fn encryption_hides_the_blocks_on_the_wire_and_pulls_stay_byte_identical() {
    for encrypt in [false, true] {
        let extra: &[&str] = if encrypt { &["--peer-encrypt"] } else { &[] };
        let x = through_proxy("pass", extra);
        let op = pull(&x.dst, x.port, &x.keys, "m", &x.data);
        assert_eq!(op.state, OpState::Done, "{op:?}");
        let t = Instant::now();
        let wire = loop {
            let w = std::fs::read(&x.wire).unwrap_or_default();
            if w.len() > 4 * PAGE || t.elapsed() > Duration::from_secs(5) {
                break w;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(wire.len() > 4 * PAGE, "recorded {} bytes", wire.len());
        let seen = x
            .data
            .iter()
            .any(|b| wire.windows(64).any(|w| w == &b[1000..1064]));
        assert_eq!(
            seen, !encrypt,
            "plaintext on the wire with encrypt={encrypt}"
        );
        let log = x.dst.log();
        assert_eq!(log.contains("every frame encrypted"), encrypt, "{log}");
    }
}

#[test]
fn key_rotation_daemons_with_old_both_and_new_keys_interoperate_and_a_removed_key_is_refused() {
    let dir = temp_dir("rotate");
    let old = key_file(&dir, "old", &[OLD]);
    let both = key_file(&dir, "both", &[NEW, OLD]);
    let new = key_file(&dir, "new", &[NEW]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, PAGE)).collect();
    let ok = |src_key: &Path, dst_key: &Path| {
        let port = free_port();
        let src = peer_source(port, &["--cluster-key", src_key.to_str().unwrap()]);
        fill(&src, &keys);
        let dst = peer_dest("127.0.0.0/8", &["--cluster-key", dst_key.to_str().unwrap()]);
        let op = pull(&dst, port, &keys, "m", &data);
        op.state == OpState::Done
    };
    // During a roll: old <-> both and both <-> new work, either way round.
    assert!(ok(&old, &both) && ok(&both, &old));
    assert!(ok(&both, &new) && ok(&new, &both));
    // Old and new alone have no key in common.
    assert!(!ok(&old, &new));
    // A live roll on one source: it holds old; a destination holds both and pulls.
    let skey = key_file(&dir, "src", &[OLD]);
    let port = free_port();
    let src = peer_source(port, &["--cluster-key", skey.to_str().unwrap()]);
    fill(&src, &keys);
    let dst = peer_dest("127.0.0.0/8", &["--cluster-key", both.to_str().unwrap()]);
    assert_eq!(pull(&dst, port, &keys, "m", &data).state, OpState::Done);
    // The source moves to the new key alone (SIGHUP re-reads its file): the destination's
    // pooled session under the old key is closed, and it redials under the new one.
    std::fs::write(
        &skey,
        format!(
            "{NEW}
"
        ),
    )
    .unwrap();
    src.signal(libc::SIGHUP);
    wait_log(&src, "cluster keys reloaded");
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    c.delete(ns, &keys).unwrap();
    let op = pull(&dst, port, &keys, "m", &data);
    assert_eq!(op.state, OpState::Done, "{op:?}");
    wait_log(&src, "closing a session whose cluster key was removed");
    // A daemon still on the old key alone is now refused.
    let stale = peer_dest("127.0.0.0/8", &["--cluster-key", old.to_str().unwrap()]);
    let op = pull(&stale, port, &keys, "m", &data);
    nothing_committed(&op);
    assert!(
        failed_with(&op.results[0], "no cluster key in common"),
        "{op:?}"
    );
    // A bad key file on SIGHUP keeps the keys in force.
    std::fs::write(
        &skey, "short
",
    )
    .unwrap();
    src.signal(libc::SIGHUP);
    wait_log(&src, "cluster keys not reloaded");
    c.delete(ns, &keys).unwrap();
    assert_eq!(pull(&dst, port, &keys, "m", &data).state, OpState::Done);
}

fn wait_log(d: &Daemon, want: &str) {
    let t = Instant::now();
    while !d.log().contains(want) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no {want:?} in {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_pull_in_a_namespace_the_source_does_not_hold_gets_misses() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let keys: Vec<Key> = (0..3).map(key).collect();
    let data = fill(&src, &keys);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    // Same digests, another model: another namespace id, so the source has none of them.
    let op = pull(&dst, port, &keys, "other-model", &data);
    assert_eq!(op.results, vec![KeyOutcome::Missed; 3], "{op:?}");
    assert_eq!(dst.client().stats().unwrap().tiers[0].blocks, 0);
    // The same keys in the source's namespace are pulled.
    assert_eq!(pull(&dst, port, &keys, "m", &data).state, OpState::Done);
}

#[test]
fn the_per_peer_cap_on_keys_in_flight_is_enforced() {
    let dir = temp_dir("cap");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        "[peer]
max_outstanding_keys = 8
",
    )
    .unwrap();
    let port = free_port();
    let src = peer_source(port, &[]);
    let keys: Vec<Key> = (0..12).map(key).collect();
    fill(&src, &keys);
    let dst = peer_dest(
        &format!("tcp://127.0.0.1:{port}"),
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--peer-connect-timeout-ms",
            "5000",
        ],
    );
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    // A frozen source keeps the first 6 keys in flight.
    src.freeze();
    let (_, first) = c
        .exists_hinted(ns, &keys[..6], Some(&hint(port, &keys[..6])))
        .unwrap();
    let first = first.unwrap();
    assert_eq!(first.state, OpState::Pulling, "{first:?}");
    // 6 more would make 12 > 8: refused at once, nothing dialled for them.
    let (_, second) = c
        .exists_hinted(ns, &keys[6..], Some(&hint(port, &keys[6..])))
        .unwrap();
    let second = second.unwrap();
    assert!(
        second
            .results
            .iter()
            .all(|r| matches!(r, KeyOutcome::Failed(f) if f.code == FailCode::PeerBusy)),
        "{second:?}"
    );
    // A refused op carries its reason once (the op's), not a copy per key.
    assert!(
        second
            .reason
            .as_ref()
            .is_some_and(|f| f.code == FailCode::PeerBusy && f.message.contains("limit 8")),
        "{second:?}"
    );
    // 2 more fit under the cap.
    let (_, third) = c
        .exists_hinted(ns, &keys[6..8], Some(&hint(port, &keys[6..8])))
        .unwrap();
    assert_eq!(third.unwrap().state, OpState::Pulling);
    src.signal(libc::SIGCONT);
    let done = c.wait(first.op, 5000).unwrap();
    assert_eq!(done.state, OpState::Done, "{done:?}");
    // Once the first keys are answered (a chunk releases its count as it ends, just after
    // its last key is reported), the rest are admitted again.
    let t = Instant::now();
    let later = loop {
        let (_, r) = c
            .exists_hinted(ns, &keys[8..], Some(&hint(port, &keys[8..])))
            .unwrap();
        let r = r.unwrap();
        if r.reason
            .as_ref()
            .is_none_or(|f| f.code != FailCode::PeerBusy)
        {
            break r;
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "never admitted again: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let later = c.wait(later.op, 5000).unwrap_or_else(|e| {
        panic!(
            "waiting for the re-admitted op: {e}; its report: {later:?}; destination log:\n{}",
            dst.log()
        )
    });
    assert_eq!(later.state, OpState::Done, "{later:?}");
}

#[test]
fn a_hint_naming_this_daemon_by_another_local_address_is_refused_before_dialling() {
    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let adv = format!("tcp://127.0.0.1:{port}");
    let peers = format!("127.0.0.0/8,tcp://localhost:{port}");
    let d = Daemon::start(&[
        "--dram",
        "256MiB",
        "--no-pin",
        "--peer-keyless-serves-every-local-user",
        "--peer-listen",
        &listen,
        "--advertise",
        &adv,
        "--peers",
        &peers,
    ]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    for host in ["127.0.0.2", "127.0.0.1", "localhost"] {
        let h = hint(port, &keys).replace("127.0.0.1", host);
        let (_, op) = c.get_hinted(ns, &keys, Some(&h), Some(2000)).unwrap();
        let op = op.unwrap();
        let names_me =
            |m: &str| m.contains("names this daemon") || m.contains("not dialling itself");
        let why = op
            .reason
            .clone()
            .or_else(|| match &op.results[0] {
                KeyOutcome::Failed(f) => Some(f.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{host}: {op:?}"));
        assert!(names_me(&why.message), "{host}: {op:?}");
    }
    assert!(!d.log().contains("peer authenticated"), "{}", d.log());
    assert!(
        !d.log().contains("peer refused"),
        "it dialled itself: {}",
        d.log()
    );
}

/// Issue 25, item 1. A keyed UCX session runs through an on-path byte forwarder that records
/// what the source sends. From that recording the attacker (`peer-attacker ucx-steal`, no
/// cluster key) looks for the source's UCX worker address, remote key and slot addresses; with
/// any it opens its own UCP endpoint, GETs a block and the arena, and PUTs over the block.
/// Protocol 3 (main at da60736) carried them in readable headers and registered the arena
/// writable: the attacker read the block and the source's own `Get` then returned `0xEE`s.
/// Waits (at most 20 s) until the proxy's recording at `wire` holds bytes and has not grown
/// for 300 ms (three of its flush intervals).
fn recorded(wire: &Path) {
    let t0 = Instant::now();
    let mut last = (0, Instant::now());
    loop {
        let len = std::fs::metadata(wire).map_or(0, |m| m.len());
        if len != last.0 {
            last = (len, Instant::now());
        } else if len > 0 && last.1.elapsed() >= Duration::from_millis(300) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the proxy recorded {len} bytes in 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_on_path_observer_of_a_keyed_ucx_session_can_neither_get_nor_put_the_source_arena() {
    const MIB: usize = 1 << 20;
    let tls = [("UCX_TLS", "tcp")];
    let dir = temp_dir("ucx-observer");
    let k = key_file(&dir, "k", &[OLD]);
    let k = k.to_str().unwrap();
    let (aport, pport) = (free_port(), free_port());
    let (listen, plisten) = (format!("127.0.0.1:{aport}"), format!("127.0.0.1:{pport}"));
    let adv = format!("tcp://{plisten}");
    let ucx = [
        "--peer-transport",
        "ucx",
        "--peer-ucx-insecure-software-rma",
        "--cluster-key",
        k,
    ];
    let mut sargs = vec!["--dram", "256MiB", "--no-pin", "--peer-listen", &listen];
    sargs.extend_from_slice(&["--advertise", &adv]);
    sargs.extend_from_slice(&ucx);
    let src = Daemon::start_env(&tls, &sargs);
    let keys: Vec<Key> = (0..4).map(key).collect();
    let mut c = src.client();
    let ns = c.register(&spec("m", MIB as u64)).unwrap().ns;
    let data: Vec<Vec<u8>> = (0..4).map(|i| block(i, MIB)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, &keys, &refs).unwrap();
    let peers = format!("tcp://{plisten}");
    let mut dargs = vec!["--dram", "256MiB", "--no-pin", "--peers", &peers];
    dargs.extend_from_slice(&["--peer-connections", "1"]);
    dargs.extend_from_slice(&ucx);
    let dst = Daemon::start_env(&tls, &dargs);
    let wire = dir.join("wire");
    let mut proxy = attacker(&["proxy", &plisten, &listen, "pass", wire.to_str().unwrap()]);
    let _out = listening(&mut proxy);
    let mut d = dst.client();
    let dns = d.register(&spec("m", MIB as u64)).unwrap().ns;
    let (pages, op) = d
        .get_hinted(dns, &keys, Some(&hint(pport, &keys)), Some(10_000))
        .unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert!(
        pages
            .iter()
            .zip(&data)
            .all(|(p, b)| p.as_deref() == Some(b.as_slice()))
    );
    assert!(
        dst.log().contains("pulling from this peer with UCX GETs"),
        "{}",
        dst.log()
    );
    // The recording holds the whole session so far (flushed every 100 ms; on a loaded
    // machine later, so wait until it has stopped growing).
    recorded(&wire);
    let out = Command::new(env!("CARGO_BIN_EXE_peer-attacker"))
        .args(["ucx-steal", wire.to_str().unwrap()])
        .envs(tls)
        .output()
        .expect("run peer-attacker");
    let _ = proxy.kill();
    let _ = proxy.wait();
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{seen}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What the source serves is what was put: nobody wrote its arena.
    let now = c.get(ns, &keys).unwrap();
    for (i, (g, b)) in now.iter().zip(&data).enumerate() {
        assert!(
            g.as_deref() == Some(b.as_slice()),
            "source block {i} overwritten: {seen}"
        );
    }
    let line = |k: &str| {
        seen.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::to_owned)
    };
    let frames: usize = line("frames=").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(frames >= 6, "the observer saw the session's frames: {seen}");
    assert_eq!(line("offers=").as_deref(), Some("0"), "{seen}");
    assert_eq!(line("slots=").as_deref(), Some("0"), "{seen}");
    assert!(line("get=").is_none() && line("put=").is_none(), "{seen}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 25, item 3. A keyless peer listener authenticates nobody, so on a daemon that
/// restricts its clients (a tenant map refusing unmapped uids, or an allowlist) any local
/// process could derive a tenant's namespace id offline (the salt is the tenant's name),
/// complete the keyless handshake on the loopback peer port and pull the tenant's blocks
/// (on main at da60736 it got every one). Such a daemon must refuse to start.
#[test]
fn a_daemon_with_a_tenant_map_or_an_allowlist_opens_no_keyless_peer_port() {
    // SAFETY: no preconditions.
    let uid = unsafe { libc::geteuid() };
    let tenants = format!(
        "socket_mode = 0o666\n[tenants]\nunmapped = \"refuse\"\n[[tenants.tenant]]\nname = \"a\"\nuids = [{uid}]\n"
    );
    let allow = format!("socket_mode = 0o666\nallow_uids = [{uid}]\n");
    for (what, cfg, salt) in [
        ("tenant map", tenants, "kvnode-tenant:a"),
        ("allowlist", allow, ""),
    ] {
        let (dir, file, sock, listen) = configured("keyless-restricted", &cfg);
        let args = [
            "--dram",
            "64MiB",
            "--no-pin",
            "--config",
            file.to_str().unwrap(),
        ];
        // The switch that admits a keyless listener does not admit it beside restrictions.
        let keyless = [
            "--peer-listen",
            &listen,
            "--peer-keyless-serves-every-local-user",
        ];
        let mut d = Daemon::spawn_at(&sock, &[&args[..], &keyless[..]].concat());
        let Some(status) = serves_or_exits(&mut d, &sock, &listen, what) else {
            keyless_intrusion(&d, &listen, salt, what)
        };
        let log = d.log();
        assert!(!status.success(), "{what}: {log}");
        assert!(
            log.contains("keyless peer listener") && log.contains("--cluster-key"),
            "{what}: {log}"
        );
        assert!(
            std::net::TcpStream::connect(&listen).is_err(),
            "{what}: port open"
        );
        // With a key the same daemon starts (and its peer port authenticates everyone).
        let k = key_file(&dir, "k", &[OLD]);
        let keyed = Daemon::start(
            &[
                &args[..],
                &[
                    "--peer-listen",
                    &listen,
                    "--cluster-key",
                    k.to_str().unwrap(),
                ],
            ]
            .concat(),
        );
        assert!(keyed.client().stats().is_ok(), "{what}");
        drop(keyed);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A private directory holding config file `cfg`: (the directory, the file, a socket path
/// in it, a free loopback peer address).
fn configured(tag: &str, cfg: &str) -> (PathBuf, PathBuf, PathBuf, String) {
    let dir = temp_dir(tag);
    let file = dir.join("kvnode.toml");
    std::fs::write(&file, cfg).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let sock = dir.join("kvnode.sock");
    (dir, file, sock, listen)
}

/// Waits until `d` either exits (its status) or serves both its socket and `listen` (None).
fn serves_or_exits(
    d: &mut Daemon,
    sock: &Path,
    listen: &str,
    what: &str,
) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(s) = d.wait_exit(Duration::from_millis(20)) {
            return Some(s);
        }
        if kvnode_client::Client::connect(sock).is_ok()
            && std::net::TcpStream::connect(listen).is_ok()
        {
            return None;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: {}", d.log());
    }
}

/// The attack on a daemon that serves a keyless peer port: its client puts 4 blocks (in
/// the namespace of `salt`), a keyless intruder on loopback pulls them. Always panics.
fn keyless_intrusion(d: &Daemon, listen: &str, salt: &str, what: &str) -> ! {
    let keys: Vec<Key> = (0..4).map(key).collect();
    fill_pages(d, &keys, PAGE);
    let mut s = spec("m", PAGE as u64);
    salt.clone_into(&mut s.tenant_salt);
    let pk: Vec<_> = keys
        .iter()
        .map(|k| kvnode_proto::peer::PullKey(k.0, k.1))
        .collect();
    let got = kvnode_e2e::keyless::keyless_pull(listen, &format!("tcp://{listen}"), s.id(), &pk);
    panic!("{what}: the daemon opened a keyless peer port; an intruder pulled {got:?} of 4 blocks")
}

/// Issue 38, item 5: with no tenant map and no allowlist, a client socket at its default
/// mode (0660) or 0600 keeps other uids out, yet a keyless peer listener let any local user
/// complete the handshake on loopback and pull every block (on 894818a the daemon started
/// and the intruder got all 4). Without a cluster key a listener now needs the switch that
/// says it serves every local user; with it the daemon starts.
#[test]
fn a_keyless_peer_listener_needs_the_switch_that_says_every_local_user_is_served() {
    for mode in ["", "socket_mode = 0o600\n"] {
        let what = if mode.is_empty() {
            "default mode"
        } else {
            "0600"
        };
        let (dir, file, sock, listen) = configured("keyless-plain", mode);
        let args = [
            "--dram",
            "64MiB",
            "--no-pin",
            "--config",
            file.to_str().unwrap(),
        ];
        let mut d = Daemon::spawn_at(&sock, &[&args[..], &["--peer-listen", &listen]].concat());
        let Some(status) = serves_or_exits(&mut d, &sock, &listen, what) else {
            keyless_intrusion(&d, &listen, "", what)
        };
        let log = d.log();
        assert!(!status.success(), "{what}: {log}");
        assert!(
            log.contains("--peer-keyless-serves-every-local-user") && log.contains("--cluster-key"),
            "{what}: the refusal does not say what to do: {log}"
        );
        let opted = [
            "--peer-listen",
            &listen,
            "--peer-keyless-serves-every-local-user",
        ];
        let served = Daemon::start_at(&sock, &[&args[..], &opted[..]].concat());
        assert!(served.client().stats().is_ok(), "{what}");
        drop(served);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Issue 38, item 8: a member that trickles its answers (one byte every 600 ms, never silent
/// for a whole io timeout) held a pull, and with it the destination's connection to that
/// member, for as long as it liked (27 s after a 1.5 s deadline in the run): a
/// client retrying the same prefix got nothing for all that time. Every frame must now arrive
/// within the io timeout plus its length at the minimum rate, so the trickled connection is
/// dropped within seconds and the retry (on a new connection, which this proxy passes
/// untouched) pulls every block byte-identical. On 894818a no retry succeeded in 12 s.
#[test]
fn a_source_that_trickles_its_answers_is_cut_off_within_seconds() {
    // More keys than a pull received in place (that one ends at the op's deadline anyway):
    // this pull runs on a pool thread, on the destination's one connection to the source.
    let x = proxied_keys("trickle", &[], PAGE, true, 8);
    let mut c = x.dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let h = hint(x.port, &x.keys);
    let t = Instant::now();
    let (_, op) = c.get_hinted(ns, &x.keys, Some(&h), Some(1500)).unwrap();
    let op = op.unwrap();
    assert!(
        !op.results.iter().any(|r| matches!(r, KeyOutcome::Pulled)),
        "the trickled pull delivered blocks: {op:?}"
    );
    let mut last = op;
    let took = loop {
        if t.elapsed() > Duration::from_secs(12) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
        let (pages, op) = c.get_hinted(ns, &x.keys, Some(&h), Some(2000)).unwrap();
        last = op.unwrap();
        if last.state == OpState::Done {
            for (i, p) in pages.iter().enumerate() {
                assert_eq!(p.as_deref(), Some(x.data[i].as_slice()), "page {i}");
            }
            break Some(t.elapsed());
        }
    };
    let took = took.unwrap_or_else(|| panic!("no retry pulled the prefix in 12 s: {last:?}"));
    assert!(took < Duration::from_secs(8), "pulled only after {took:?}");
}
