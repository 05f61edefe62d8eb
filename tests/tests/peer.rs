//! Peer pulls between real daemons on loopback: hinted gets, refused hints, authorization
//! before dialling, cluster keys, and nothing completed thrown away. Under the UCX pass
//! (`KVNODE_E2E_PEER_TRANSPORT=ucx`) every successful pull is shown by the UCX counters to
//! have moved its blocks by GET.
//! Run: `cargo test --release -p kvnode-e2e --test peer`.

use std::io::ErrorKind;

use kvnode_e2e::peerstats::UcxCounts;
use kvnode_e2e::{block, free_port, hint, key, peer_dest, peer_source, spec};
use kvnode_proto::Key;
use kvnode_proto::pull::{FailCode, KeyOutcome, OpState};

const PAGE: usize = 64 << 10;

fn fill(d: &kvnode_e2e::Daemon, keys: &[Key]) -> u32 {
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let data: Vec<Vec<u8>> = (0..keys.len() as u64).map(|i| block(i, PAGE)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, keys, &refs).unwrap();
    ns
}

#[test]
fn hinted_get_pulls_the_missing_prefix_and_later_gets_hit_locally() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..8).map(key).collect();
    fill(&src, &keys);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    c.put(ns, &keys[..1], &[&block(0, PAGE)]).unwrap();
    let (pages, op) = c
        .get_hinted(ns, &keys, Some(&hint(port, &keys)), Some(5000))
        .unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert_eq!(op.results[0], KeyOutcome::HitLocal);
    assert!(
        op.results[1..].iter().all(|r| *r == KeyOutcome::Pulled),
        "{op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, PAGE).as_slice()),
            "page {i}"
        );
    }
    assert_eq!(c.exists(ns, &keys).unwrap(), 8);
    // Under the UCX pass the pages came by UCX GETs, with no fallback to TCP.
    kvnode_e2e::peerstats::assert_pulled_over_ucx(&dst, &src);
    // The source held leases only while sending (UCX: until the destination's `Landed`,
    // which may trail the answer by a moment).
    let t = std::time::Instant::now();
    while src.client().stats().unwrap().tiers[0].leases != 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(2),
            "source leases outlive the pull"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The declared timeouts come from this pull's measurements and cover them: a model
    // that fell below the measured tail would cut off pulls that succeed today.
    let t = c.timeouts().unwrap();
    assert!(t.measured, "{t:?}");
    let f = &t.figures[0];
    assert_eq!(f.peer, format!("tcp://127.0.0.1:{port}"));
    assert!(f.samples >= 1, "{t:?}");
    assert!(
        t.base_s * 1000.0 >= f.first_p99_ms + f.connect_p99_ms,
        "base {} s below the measured first answer + connect: {t:?}",
        t.base_s
    );
    assert!(
        t.per_page_s * 1000.0 >= f.per_page_p99_ms,
        "per page {} s below the measured per-page p99: {t:?}",
        t.per_page_s
    );
}

/// `hint` with its first block hash replaced by `with` (only inside `block_hashes`: a short
/// hash such as "0" also occurs in the endpoint's digits).
fn with_first_hash(hint: &str, keys: &[Key], with: &str) -> String {
    let first = format!("[{},", keys[0].0.router_hash());
    assert!(hint.contains(&first), "{hint}");
    hint.replacen(&first, &format!("[{with},"), 1)
}

#[test]
fn bad_hints_are_refused_with_a_reason_while_local_hits_still_succeed() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..4).map(key).collect();
    fill(&src, &keys);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    c.put(ns, &keys[..1], &[&block(0, PAGE)]).unwrap();
    let good = hint(port, &keys);
    let cases = [
        ("{".to_owned(), "not a JSON object"),
        (good.replace("tcp://", "udp://"), "not tcp://host:port"),
        (good.replace("127.0.0.1", "0.0.0.0"), "bind wildcard"),
        (with_first_hash(&good, &keys, "-3"), "not an integer"),
        (with_first_hash(&good, &keys, "7"), "another prefix"),
        (
            r#"{"protocol_version":"9","actions":[]}"#.to_owned(),
            "protocol_version",
        ),
    ];
    for (h, want) in cases {
        let (pages, op) = c.get_hinted(ns, &keys, Some(&h), Some(2000)).unwrap();
        let op = op.unwrap();
        let why = op.reason.clone().expect("a refused hint says why");
        assert_eq!(why.code, FailCode::MalformedHint, "{h}: {op:?}");
        assert!(why.message.contains(want), "{h}: {op:?}");
        assert_eq!(op.results[0], KeyOutcome::HitLocal);
        assert_eq!(op.leading, 1);
        assert_eq!(pages[0].as_deref(), Some(block(0, PAGE).as_slice()));
        assert!(pages[1..].iter().all(Option::is_none));
    }
    // Exists with a bad hint: count of local keys, reason given, nothing started.
    let (n, op) = c.exists_hinted(ns, &keys, Some("[]")).unwrap();
    assert_eq!(n, 1);
    let why = op.unwrap().reason.unwrap();
    assert_eq!(why.code, FailCode::MalformedHint);
    assert!(why.message.contains("not a JSON object"));
    assert_eq!(c.exists(ns, &keys).unwrap(), 1);
}

#[test]
fn unauthorized_endpoint_is_never_dialled() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    fill(&src, &keys);
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_port = trap.local_addr().unwrap().port();
    // Only the real source is allowed; the trap is not.
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let (pages, op) = c
        .get_hinted(ns, &keys, Some(&hint(trap_port, &keys)), Some(2000))
        .unwrap();
    let op = op.unwrap();
    let why = op.reason.unwrap();
    assert_eq!(why.code, FailCode::NotAuthorized);
    assert!(why.message.contains("not an authorized peer"));
    assert!(pages.iter().all(Option::is_none));
    let (_, op) = c
        .exists_hinted(ns, &keys, Some(&hint(trap_port, &keys)))
        .unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Failed);
    let why = op.reason.unwrap();
    assert_eq!(why.code, FailCode::NotAuthorized);
    assert!(why.message.contains("not an authorized peer"));
    // The op has ended: a dial, had there been one, came before that, and the kernel has
    // already queued its connection on the trap's backlog (accepted or not).
    match trap.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the unauthorized endpoint was dialled: {other:?}"),
    }
    // Non-loopback endpoints are refused without a cluster key even if they parse.
    let far = hint(port, &keys).replace("127.0.0.1", "10.9.9.9");
    let (_, op) = c.get_hinted(ns, &keys, Some(&far), Some(2000)).unwrap();
    let why = op.unwrap().reason.unwrap();
    assert_eq!(why.code, FailCode::NotAuthorized);
    assert!(why.message.contains("no cluster key"));
}

#[test]
fn wrong_or_missing_cluster_key_is_refused_and_nothing_is_committed() {
    let dir = kvnode_e2e::temp_dir("keys");
    let (ka, kb) = (dir.join("a.key"), dir.join("b.key"));
    std::fs::write(&ka, "cluster-key-aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    std::fs::write(&kb, "cluster-key-bbbbbbbbbbbbbbbbbbbbbbbb\n").unwrap();
    let port = free_port();
    let src = peer_source(port, &["--cluster-key", ka.to_str().unwrap()]);
    let keys: Vec<Key> = (0..3).map(key).collect();
    fill(&src, &keys);
    let peers = format!("tcp://127.0.0.1:{port}");
    let cases = [
        (vec!["--cluster-key", kb.to_str().unwrap()], "cluster key"),
        (vec![], "cluster key"),
        (vec!["--cluster-key", ka.to_str().unwrap()], ""),
    ];
    for (extra, want) in cases {
        let dst = peer_dest(&peers, &extra);
        let mut c = dst.client();
        let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
        let (_, op) = c
            .get_hinted(ns, &keys, Some(&hint(port, &keys)), Some(3000))
            .unwrap();
        let op = op.unwrap();
        if want.is_empty() {
            assert_eq!(op.state, OpState::Done, "same key must work: {op:?}");
            kvnode_e2e::peerstats::assert_pulled_over_ucx(&dst, &src);
            continue;
        }
        assert_eq!(op.state, OpState::Failed, "{op:?}");
        assert!(
            matches!(&op.results[0], KeyOutcome::Failed(r)
                if r.code == FailCode::PeerRefused && r.message.contains(want)),
            "{extra:?}: {op:?}"
        );
        assert_eq!(c.exists(ns, &keys).unwrap(), 0);
        assert_eq!(c.stats().unwrap().tiers[0].reserved, 0);
    }
    assert!(src.log().contains("peer refused"), "{}", src.log());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn each_request_follows_its_own_hint_to_its_own_peer() {
    let (pa, pb) = (free_port(), free_port());
    let (a, b) = (peer_source(pa, &[]), peer_source(pb, &[]));
    let ka: Vec<Key> = (0..3).map(key).collect();
    let kb: Vec<Key> = (100..103).map(key).collect();
    fill(&a, &ka);
    fill(&b, &kb);
    // A CIDR admits both sources.
    let dst = peer_dest("127.0.0.0/8", &[]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let (_, ra) = c
        .get_hinted(ns, &ka, Some(&hint(pa, &ka)), Some(3000))
        .unwrap();
    let (_, rb) = c
        .get_hinted(ns, &kb, Some(&hint(pb, &kb)), Some(3000))
        .unwrap();
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        (ra.state, rb.state),
        (OpState::Done, OpState::Done),
        "{ra:?} {rb:?}"
    );
    assert_eq!(ra.peer, Some(format!("tcp://127.0.0.1:{pa}")));
    assert_eq!(rb.peer, Some(format!("tcp://127.0.0.1:{pb}")));
    // Under the UCX pass each peer's three blocks came by GET from that peer.
    if kvnode_e2e::peer_transport() == "ucx" {
        for p in [pa, pb] {
            let got = UcxCounts::of_peer(&dst, &format!("tcp://127.0.0.1:{p}"));
            assert_eq!((got.gets, got.fallbacks), (3, 0), "peer {p}: {got:?}");
        }
    }
    // A hint naming the wrong peer for a prefix pulls nothing wrong: the peer misses.
    let (pages, r) = c
        .get_hinted(ns, &kb[..1], Some(&hint(pa, &kb[..1])), Some(3000))
        .unwrap();
    assert!(pages[0].is_some(), "already local");
    assert_eq!(r.unwrap().results[0], KeyOutcome::HitLocal);
    let fresh = [key(200)];
    let (pages, r) = c
        .get_hinted(ns, &fresh, Some(&hint(pa, &fresh)), Some(3000))
        .unwrap();
    assert!(pages[0].is_none());
    assert_eq!(r.unwrap().results[0], KeyOutcome::Missed);
}

#[test]
fn cli_get_takes_a_hint_from_a_file_and_stats_show_the_declared_timeouts() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..2).map(key).collect();
    let hex: Vec<String> = keys.iter().map(|k| k.0.to_hex()).collect();
    let file = dst.dir.join("hint.json");
    let envelope = format!(
        r#"{{"protocol_version":"0.1","message_id":"m","actions":[{{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{}}}]}}"#,
        hint(port, &keys)
    );
    std::fs::write(&file, envelope).unwrap();
    let run = |d: &kvnode_e2e::Daemon, args: &[&str]| {
        let out = std::process::Command::new(kvnode_e2e::kvnode_bin())
            .args(args)
            .arg("--socket")
            .arg(d.socket())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let page = format!("{PAGE}");
    let hint_arg = format!("@{}", file.display());
    // The CLI's namespace flags are identical on both sides, so the keys match.
    let ns_args = [
        "--model",
        "m",
        "--page-bytes",
        &page,
        "--keys",
        &hex.join(","),
    ];
    run(&src, &[&["put", "--seed", "1"][..], &ns_args].concat());
    let got = run(
        &dst,
        &[
            "get",
            "--model",
            "m",
            "--page-bytes",
            &page,
            "--keys",
            &hex.join(","),
            "--hint",
            &hint_arg,
        ],
    );
    assert!(got.contains("Done, 2 leading usable"), "{got}");
    assert!(got.contains("2 of 2 leading pages hit"), "{got}");
    kvnode_e2e::peerstats::assert_pulled_over_ucx(&dst, &src);
    let stats = run(&dst, &["stats"]);
    assert!(
        stats.contains("prefetch timeout: base_s") && stats.contains("(measured)"),
        "{stats}"
    );
    assert!(
        stats.contains(&format!("tcp://127.0.0.1:{port}")),
        "{stats}"
    );
}
