//! The router entry (docs/router-entry.md) with real daemons: a router's signed prefetch at
//! placement pulls the named prefix from a peer before any engine asks, the engine's plain
//! get then finds it local; unsigned, forged, tampered, stale and replayed requests are
//! refused and act on nothing; the daemon refuses to start the entry without its keys.
//! Run: `cargo test --release -p kvnode-e2e --test router_entry`.

use std::path::Path;
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::router::{key_of, now_ms, post, post_signed, signed_headers};
use kvnode_e2e::{Daemon, block, free_port, key, peer_dest, peer_source, spec, temp_dir, tier};
use kvnode_proto::Key;
use kvnode_proto::actions::{ActionOutcome, Refusal};
use kvnode_proto::client::{BlockMeta, PutStatus};
use kvnode_proto::router::RouterReply;

const PAGE: usize = 64 << 10;
const CLUSTER_KEY: &str = "router-entry-test-cluster-key-aaaaaaaa";
const OTHER_KEY: &str = "router-entry-test-cluster-key-bbbbbbbb";

/// Tokens of block `i` (exact, so the block is announced).
fn meta(i: u64) -> BlockMeta {
    BlockMeta {
        tokens: (0..16).map(|j| (i * 16 + j) as u32).collect(),
        parent: i.checked_sub(1).map(|p| key(p).0),
    }
}

fn ns_spec() -> kvnode_proto::NamespaceSpec {
    kvnode_proto::NamespaceSpec {
        page_size: 16,
        ..spec("m", PAGE as u64)
    }
}

/// Stores blocks `ids` with their token metadata (so they are announced).
fn put(c: &mut Client, ns: u32, ids: std::ops::Range<u64>) {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, PAGE)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let metas = chunk.iter().map(|&i| Some(meta(i))).collect();
        let r = c.put_with_meta(ns, &keys, &refs, metas).unwrap();
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    }
}

/// Events on, as ipc sockets in a private directory.
fn events_args(dir: &Path) -> Vec<String> {
    vec![
        "--events".into(),
        format!("ipc://{}", dir.join("ev.sock").display()),
    ]
}

fn key_file(dir: &Path) -> String {
    let p = dir.join("cluster.key");
    std::fs::write(&p, format!("{CLUSTER_KEY}\n")).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p.display().to_string()
}

fn body(actions: &serde_json::Value) -> Vec<u8> {
    serde_json::json!({"model": "m", "hints": {"protocol_version": "1.0", "message_id": "r1",
        "actions": actions}})
    .to_string()
    .into_bytes()
}

fn hashes(ids: std::ops::Range<u64>) -> Vec<u64> {
    ids.map(|i| key(i).0.router_hash()).collect()
}

fn router_stats(c: &mut Client) -> kvnode_proto::stats::RouterStats {
    c.stats().unwrap().router
}

/// A destination serving the router entry on `rport`, pulling from `127.0.0.1:*`.
fn dest_with_entry(k: &str, rport: u16) -> Daemon {
    let ev = temp_dir("router-dst-ev");
    let mut args: Vec<String> = vec![
        "--cluster-key".into(),
        k.into(),
        "--router-listen".into(),
        format!("127.0.0.1:{rport}"),
    ];
    args.extend(events_args(&ev));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    peer_dest("127.0.0.0/8", &refs)
}

/// A daemon serving the router entry, and an engine client of it with the namespace
/// registered: (daemon, client, ns, the entry's port).
fn entry_alone(tag: &str) -> (Daemon, Client, u32, u16) {
    let k = key_file(&temp_dir(tag));
    let rport = free_port();
    let d = dest_with_entry(&k, rport);
    let mut c = d.client();
    let ns = c.register(&ns_spec()).unwrap().ns;
    (d, c, ns, rport)
}

#[test]
fn a_router_prefetch_at_placement_pulls_the_prefix_before_the_engine_asks_and_its_get_is_local() {
    let dir = temp_dir("router-entry");
    let k = key_file(&dir);
    let port = free_port();
    let src_ev = temp_dir("router-src-ev");
    let mut sargs: Vec<String> = vec!["--cluster-key".into(), k.clone()];
    sargs.extend(events_args(&src_ev));
    let srefs: Vec<&str> = sargs.iter().map(String::as_str).collect();
    let src = peer_source(port, &srefs);
    let mut s = src.client();
    let sns = s.register(&ns_spec()).unwrap().ns;
    put(&mut s, sns, 0..8);
    let rport = free_port();
    let dst = dest_with_entry(&k, rport);
    // The engine on the destination registers its namespace; it asks for nothing yet.
    let mut c = dst.client();
    let ns = c.register(&ns_spec()).unwrap().ns;
    let keys: Vec<Key> = (0..8).map(key).collect();
    assert_eq!(c.exists(ns, &keys).unwrap(), 0);
    // The router places the request here and sends the prefetch first. Hash 99 names
    // nothing the source holds.
    let mut named = hashes(0..8);
    named.push(key(99).0.router_hash());
    let req = body(
        &serde_json::json!([{"action_id": "p", "action_type": "kv.prefetch",
        "action_version": "1.0", "payload": {
            "source_control_endpoint": format!("tcp://127.0.0.1:{port}"),
            "block_hashes": named}}]),
    );
    let key = key_of(CLUSTER_KEY);
    let (status, text) = post_signed(rport, &key, &req);
    assert_eq!(status, 200, "{text}");
    let reply: RouterReply = serde_json::from_str(&text).unwrap();
    assert_eq!(reply.message_id, "r1");
    assert_eq!(reply.namespaces.len(), 1, "{reply:?}");
    let r = &reply.namespaces[0].results[0];
    assert!(matches!(r.outcome, ActionOutcome::Pulling(_)), "{r:?}");
    // The blocks land without any engine request.
    let t = Instant::now();
    while c.exists(ns, &keys).unwrap() < 8 {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "prefetch did not land"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let served = tier(&mut s, "dram").hits;
    assert_eq!(served, 8, "the source served each block once");
    let rs = router_stats(&mut s);
    assert_eq!((rs.resolve_asked, rs.resolve_found), (9, 8), "{rs:?}");
    // The engine's own plain get (no hint) reads every page, right bytes, from local DRAM.
    let pages = c.get(ns, &keys).unwrap();
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, PAGE).as_slice()),
            "page {i}"
        );
    }
    assert_eq!(tier(&mut s, "dram").hits, served, "the source served again");
    let d = router_stats(&mut c);
    assert!(d.serving, "{d:?}");
    assert_eq!(
        (d.accepted, d.refused_auth, d.refused_replay),
        (1, 0, 0),
        "{d:?}"
    );
}

/// What is sent: a name, the headers, the body.
type Attempt<'a> = (&'a str, Vec<(String, String)>, &'a [u8]);

#[test]
fn unsigned_forged_tampered_stale_and_replayed_requests_are_refused_and_act_on_nothing() {
    let (_d, mut c, ns, rport) = entry_alone("router-auth");
    put(&mut c, ns, 0..4);
    let req = body(
        &serde_json::json!([{"action_id": "r", "action_type": "kv.retain",
        "action_version": "1.0", "payload": {"block_hashes": hashes(0..4), "ttl_seconds": 60}}]),
    );
    let good = key_of(CLUSTER_KEY);
    let now = now_ms();
    let mut tampered = req.clone();
    *tampered.last_mut().unwrap() = b' ';
    let attempts: Vec<Attempt<'_>> = vec![
        ("unsigned", vec![], &req),
        (
            "another cluster's key",
            signed_headers(&key_of(OTHER_KEY), now, &req),
            &req,
        ),
        ("tampered body", signed_headers(&good, now, &req), &tampered),
        ("stale", signed_headers(&good, now - 60_000, &req), &req),
        (
            "from the future",
            signed_headers(&good, now + 60_000, &req),
            &req,
        ),
    ];
    for (what, headers, b) in &attempts {
        let (status, text) = post(rport, headers, b);
        assert_eq!(status, 401, "{what}: {text}");
        assert!(text.contains("\"error\""), "{what}: {text}");
    }
    assert_eq!(
        tier(&mut c, "dram").retained_blocks,
        0,
        "a refused request acted"
    );
    let signed = signed_headers(&good, now_ms(), &req);
    let (status, text) = post(rport, &signed, &req);
    assert_eq!(status, 200, "{text}");
    let reply: RouterReply = serde_json::from_str(&text).unwrap();
    match &reply.namespaces[0].results[0].outcome {
        ActionOutcome::Done { blocks, .. } => assert_eq!(*blocks, 4, "{reply:?}"),
        o => panic!("{o:?}"),
    }
    assert_eq!(tier(&mut c, "dram").retained_blocks, 4);
    let (status, text) = post(rport, &signed, &req);
    assert_eq!(status, 401, "a replay was accepted: {text}");
    assert!(text.contains("replay"), "{text}");
    let s = router_stats(&mut c);
    assert_eq!(
        (
            s.accepted,
            s.refused_auth,
            s.refused_replay,
            s.refused_invalid
        ),
        (1, 3, 3, 0),
        "{s:?}"
    );
    // Authenticated but naming no namespace of this node, or a bad envelope.
    let other_model = serde_json::json!({"model": "nope", "hints": {"protocol_version": "1.0",
        "message_id": "x", "actions": []}})
    .to_string();
    let (status, _) = post_signed(rport, &good, other_model.as_bytes());
    assert_eq!(status, 404);
    let (status, text) = post_signed(
        rport,
        &good,
        br#"{"model":"m","hints":{"protocol_version":"9"}}"#,
    );
    assert_eq!(status, 400, "{text}");
    assert_eq!(router_stats(&mut c).refused_invalid, 2);
}

#[test]
fn a_prefetch_from_an_unreachable_source_is_refused_by_name() {
    let (_d, _c, _, rport) = entry_alone("router-unreach");
    let dead = free_port();
    let req = body(
        &serde_json::json!([{"action_id": "p", "action_type": "kv.prefetch",
        "action_version": "1.0", "payload": {
            "source_control_endpoint": format!("tcp://127.0.0.1:{dead}"),
            "block_hashes": hashes(0..2)}}]),
    );
    let (status, text) = post_signed(rport, &key_of(CLUSTER_KEY), &req);
    assert_eq!(status, 200, "{text}");
    let reply: RouterReply = serde_json::from_str(&text).unwrap();
    match &reply.namespaces[0].results[0].outcome {
        ActionOutcome::Refused { code, message } => {
            assert_eq!(*code, Refusal::SourceFailed, "{message}");
            assert!(message.contains(&dead.to_string()), "{message}");
        }
        o => panic!("{o:?}"),
    }
}

/// Starts a daemon with the router entry on a free port plus `extra`; it must refuse to
/// start, saying `why`.
fn refuses_to_start(extra: &[&str], why: &str) {
    let rl = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["--dram", "64MiB", "--no-pin", "--router-listen", &rl];
    args.extend_from_slice(extra);
    let (st, log) = Daemon::start_failing(&args, Duration::from_secs(20));
    assert!(!st.success());
    assert!(log.contains(why), "{log}");
}

#[test]
fn the_entry_does_not_start_without_a_cluster_key_or_events() {
    let k = key_file(&temp_dir("router-start"));
    let ev = temp_dir("router-start-ev");
    let events = format!("ipc://{}", ev.join("ev.sock").display());
    refuses_to_start(
        &["--events", &events],
        "authenticates routers with the cluster key",
    );
    refuses_to_start(
        &["--cluster-key", &k, "--peers", "127.0.0.0/8"],
        "names blocks by the hashes of the KV events",
    );
}
