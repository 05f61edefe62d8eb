//! A router's actions (`Act`: kv.retain, kv.release, kv.demote, kv.evict, kv.prefetch, an
//! unknown action) executed by real daemons, over the client socket, with real eviction
//! pressure, a real spill tier, a real takeover and a real peer pull.
//! Run: `cargo test --release -p kvnode-e2e --test actions`.

use std::path::Path;
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::{
    Daemon, block, free_port, key, peer_dest, peer_source, spec, spill_dir, temp_dir, tier,
};
use kvnode_proto::Key;
use kvnode_proto::actions::{ActionOutcome, ActionResult, Refusal};
use kvnode_proto::client::PutStatus;
use kvnode_proto::pull::{KeyOutcome, OpState};

const PAGE: usize = 64 << 10;

/// A small DRAM tier: 16 MiB of 2 MiB slabs, unpinned.
const SMALL: [&str; 5] = ["--dram", "16MiB", "--slab-size", "2MiB", "--no-pin"];

fn envelope(actions: &[(&str, serde_json::Value)]) -> String {
    let actions: Vec<serde_json::Value> = actions
        .iter()
        .enumerate()
        .map(|(i, (kind, payload))| {
            serde_json::json!({"action_id": format!("a{i}"), "action_type": kind,
                "action_version": "1.0", "payload": payload})
        })
        .collect();
    serde_json::json!({"protocol_version": "1.0", "message_id": "m1", "actions": actions})
        .to_string()
}

/// Router hashes of `keys`, as Dynamo's session policy writes them (decimal strings).
fn hashes(keys: &[Key]) -> serde_json::Value {
    keys.iter()
        .map(|k| serde_json::Value::String(k.0.router_hash().to_string()))
        .collect()
}

fn put(c: &mut Client, ns: u32, ids: std::ops::Range<u64>) {
    for chunk in ids.collect::<Vec<_>>().chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, PAGE)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let r = c.put(ns, &keys, &refs).unwrap();
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    }
}

/// Which of `ids` are held in DRAM with their right bytes.
fn intact(c: &mut Client, ns: u32, ids: std::ops::Range<u64>) -> Vec<u64> {
    ids.filter(|&i| c.get(ns, &[key(i)]).unwrap()[0].as_deref() == Some(block(i, PAGE).as_slice()))
        .collect()
}

fn act(
    c: &mut Client,
    ns: u32,
    keys: &[Key],
    actions: &[(&str, serde_json::Value)],
) -> Vec<ActionResult> {
    let (id, results) = c.act(ns, keys, &envelope(actions)).unwrap();
    assert_eq!(id, "m1");
    assert_eq!(results.len(), actions.len(), "{results:?}");
    results
}

/// A client of `d` with blocks `0..n` of namespace "m" stored: (client, ns, their keys).
fn stocked(d: &Daemon, n: u64) -> (Client, u32, Vec<Key>) {
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    put(&mut c, ns, 0..n);
    (c, ns, (0..n).map(key).collect())
}

fn done_blocks(r: &ActionResult) -> u32 {
    match &r.outcome {
        ActionOutcome::Done { blocks, .. } => *blocks,
        o => panic!("{} not done: {o:?}", r.action_type),
    }
}

#[test]
fn retained_blocks_survive_dram_pressure_until_their_ttl_then_leave() {
    let d = Daemon::start(&SMALL);
    let (mut c, ns, _) = stocked(&d, 8);
    let held: Vec<Key> = (0..4).map(key).collect();
    let r = act(
        &mut c,
        ns,
        &held,
        &[(
            "kv.retain",
            serde_json::json!({"block_hashes": hashes(&held), "ttl_seconds": 4.0, "priority": 3}),
        )],
    );
    assert_eq!(done_blocks(&r[0]), 4, "{r:?}");
    let t = tier(&mut c, "dram");
    assert_eq!((t.retained_blocks, t.retained_bytes), (4, 4 * PAGE as u64));
    // 24 MiB more through a 16 MiB tier: LRU would take blocks 0..8 first.
    put(&mut c, ns, 100..484);
    assert_eq!(
        intact(&mut c, ns, 0..8),
        vec![0, 1, 2, 3],
        "held blocks kept, others evicted"
    );
    let t = tier(&mut c, "dram");
    assert!(t.evictions > 100, "{t:?}");
    assert_eq!(t.retained_blocks, 4);
    // Past the TTL the holds end and the same pressure takes them.
    std::thread::sleep(Duration::from_millis(4200));
    put(&mut c, ns, 500..884);
    assert_eq!(
        intact(&mut c, ns, 0..4),
        Vec::<u64>::new(),
        "holds outlived their TTL"
    );
    let t = tier(&mut c, "dram");
    assert_eq!((t.retained_blocks, t.retained_bytes), (0, 0));
    assert_eq!(t.retain_expired, 4);
}

#[test]
fn retention_is_bounded_by_the_retained_quota_and_ends_at_release() {
    // No tenant map: retention may hold half the 16 MiB tier, 8 MiB = 128 pages.
    let d = Daemon::start(&SMALL);
    let (mut c, ns, keys) = stocked(&d, 160);
    let r = act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.retain",
            serde_json::json!({"block_hashes": hashes(&keys), "ttl_seconds": 60}),
        )],
    );
    let ActionOutcome::Done {
        blocks,
        skipped,
        note,
    } = &r[0].outcome
    else {
        panic!("{r:?}")
    };
    assert_eq!((*blocks, *skipped), (128, 32), "{note}");
    assert!(
        note.contains("32 keys are over the tenant's retained quota"),
        "{note}"
    );
    let t = tier(&mut c, "dram");
    assert_eq!((t.retained_blocks, t.retain_refused), (128, 32));
    // A put that needs room still gets it: the other half of the tier is evictable.
    put(&mut c, ns, 1000..1100);
    // kv.release ends the holds; the blocks stay cached until pressure takes them.
    let r = act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.release",
            serde_json::json!({"block_hashes": hashes(&keys)}),
        )],
    );
    assert_eq!(done_blocks(&r[0]), 128, "{r:?}");
    assert_eq!(tier(&mut c, "dram").retained_blocks, 0);
    put(&mut c, ns, 2000..2300);
    assert!(
        intact(&mut c, ns, 0..128).len() < 10,
        "released blocks still pinned"
    );
}

#[test]
fn retention_survives_a_takeover() {
    let sock_dir = temp_dir("act-takeover");
    let sock = sock_dir.join("kvnode.sock");
    let mut a = Daemon::start_at(&sock, &SMALL);
    let (mut c, ns, _) = stocked(&a, 8);
    let held: Vec<Key> = (0..4).map(key).collect();
    act(
        &mut c,
        ns,
        &held,
        &[(
            "kv.retain",
            serde_json::json!({"block_hashes": hashes(&held), "ttl_seconds": 600}),
        )],
    );
    drop(c);
    let mut args = SMALL.to_vec();
    args.push("--takeover");
    let b = Daemon::spawn_at(&sock, &args);
    assert!(
        a.wait_exit(Duration::from_secs(30)).is_some(),
        "{}",
        a.log()
    );
    let mut c = connect_to(&sock, b.child.id());
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    assert_eq!(tier(&mut c, "dram").retained_blocks, 4, "log:\n{}", b.log());
    put(&mut c, ns, 100..484);
    assert_eq!(
        intact(&mut c, ns, 0..8),
        vec![0, 1, 2, 3],
        "log:\n{}",
        b.log()
    );
    drop(c);
    drop(b);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

/// A client of the daemon with pid `pid` at `sock` (the successor of a takeover).
fn connect_to(sock: &Path, pid: u32) -> Client {
    let t = Instant::now();
    loop {
        if let Ok(mut c) = Client::connect(sock)
            && c.stats().is_ok_and(|s| s.pid == pid)
        {
            return c;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "successor never answered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn demote_writes_the_blocks_to_nvme_and_frees_their_dram() {
    let dir = spill_dir("act-demote");
    let d = Daemon::start_roomy_spilling(&dir, &[]);
    let (mut c, ns, keys) = stocked(&d, 8);
    let before = tier(&mut c, "dram");
    let r = act(
        &mut c,
        ns,
        &keys[..6],
        &[(
            "kv.demote",
            serde_json::json!({"block_hashes": hashes(&keys[..6])}),
        )],
    );
    assert_eq!(done_blocks(&r[0]), 6, "{r:?}");
    let after = tier(&mut c, "dram");
    assert_eq!(after.blocks, before.blocks - 6);
    assert_eq!(after.bytes, before.bytes - 6 * PAGE as u64);
    assert_eq!(tier(&mut c, "nvme").blocks, 6);
    // Every block still reads back right (the six from NVMe, promoted by the get).
    let got = c.get(ns, &keys).unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(
            g.as_deref(),
            Some(block(i as u64, PAGE).as_slice()),
            "block {i}"
        );
    }
    // Without an NVMe tier the action is refused, naming why.
    let plain = Daemon::start(&SMALL);
    let (mut c, ns, _) = stocked(&plain, 2);
    let r = act(
        &mut c,
        ns,
        &keys[..2],
        &[(
            "kv.demote",
            serde_json::json!({"block_hashes": hashes(&keys[..2])}),
        )],
    );
    match &r[0].outcome {
        ActionOutcome::Refused {
            code: Refusal::Unsupported,
            message,
        } => {
            assert!(message.contains("no NVMe tier"), "{message}");
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(
        tier(&mut c, "dram").blocks,
        2,
        "a refused demote changed nothing"
    );
}

#[test]
fn prefetch_from_nvme_promotes_the_named_blocks_into_dram() {
    let dir = spill_dir("act-promote");
    let d = Daemon::start_roomy_spilling(&dir, &[]);
    let (mut c, ns, keys) = stocked(&d, 8);
    act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.demote",
            serde_json::json!({"block_hashes": hashes(&keys)}),
        )],
    );
    assert_eq!(tier(&mut c, "dram").blocks, 0);
    let r = act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.prefetch",
            serde_json::json!({"block_hashes": hashes(&keys[..5])}),
        )],
    );
    assert_eq!(
        r[0].outcome,
        ActionOutcome::Started {
            blocks: 5,
            skipped: 0
        }
    );
    let t = Instant::now();
    while tier(&mut c, "dram").blocks < 5 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "promotion never landed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let promoted_before = tier(&mut c, "dram").promotions;
    assert_eq!(promoted_before, 5);
    // The get finds them in DRAM: no promotion of its own for the prefetched five.
    let got = c.get(ns, &keys[..5]).unwrap();
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, g)| g.as_deref() == Some(block(i as u64, PAGE).as_slice()))
    );
    assert_eq!(tier(&mut c, "dram").promotions, promoted_before);
}

#[test]
fn prefetch_from_a_peer_lands_before_the_request_and_its_get_pulls_nothing() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..8).map(key).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", PAGE as u64)).unwrap().ns;
    put(&mut s, sns, 0..8);
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE as u64)).unwrap().ns;
    let r = act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.prefetch",
            serde_json::json!({"source_control_endpoint": format!("tcp://127.0.0.1:{port}"),
            "block_hashes": hashes(&keys)}),
        )],
    );
    let ActionOutcome::Pulling(op) = &r[0].outcome else {
        panic!("{r:?}")
    };
    let op = c.wait(op.op, 10_000).unwrap();
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert!(
        op.results.iter().all(|k| *k == KeyOutcome::Pulled),
        "{op:?}"
    );
    // Every block the source serves is leased from its DRAM tier, a hit there.
    let served = tier(&mut s, "dram").hits;
    // The request's own hinted get finds every page local and dials nobody.
    let hint = kvnode_e2e::hint(port, &keys);
    let (pages, op) = c.get_hinted(ns, &keys, Some(&hint), Some(5000)).unwrap();
    let op = op.unwrap();
    assert!(
        op.results.iter().all(|k| *k == KeyOutcome::HitLocal),
        "{op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, PAGE).as_slice()),
            "page {i}"
        );
    }
    assert_eq!(
        tier(&mut s, "dram").hits,
        served,
        "the source served a second pull"
    );
}

#[test]
fn an_unknown_action_is_refused_by_name_and_the_others_still_run() {
    let d = Daemon::start(&SMALL);
    let (mut c, ns, keys) = stocked(&d, 4);
    let r = act(
        &mut c,
        ns,
        &keys,
        &[
            (
                "kv.share",
                serde_json::json!({"block_hashes": hashes(&keys)}),
            ),
            (
                "kv.evict",
                serde_json::json!({"block_hashes": hashes(&keys[..2])}),
            ),
            (
                "kv.retain",
                serde_json::json!({"block_hashes": hashes(&keys), "ttl_seconds": -1}),
            ),
        ],
    );
    match &r[0].outcome {
        ActionOutcome::Refused {
            code: Refusal::Unsupported,
            message,
        } => {
            assert!(message.contains("\"kv.share\""), "{message}");
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(done_blocks(&r[1]), 2, "{r:?}");
    assert!(
        matches!(&r[2].outcome, ActionOutcome::Refused { code: Refusal::Invalid, message } if message.contains("ttl_seconds")),
        "{r:?}"
    );
    assert_eq!(
        intact(&mut c, ns, 0..4),
        vec![2, 3],
        "kv.evict removed the named blocks only"
    );
    assert_eq!(
        tier(&mut c, "dram").retained_blocks,
        0,
        "the refused retain held nothing"
    );
    // A malformed envelope is refused whole, and the connection keeps serving.
    let e = c
        .act(ns, &keys, "{\"protocol_version\":\"7\",\"actions\":[]}")
        .unwrap_err();
    assert!(e.to_string().contains("protocol_version"), "{e}");
    assert_eq!(c.exists(ns, &keys[2..]).unwrap(), 2);
}

#[test]
fn a_get_joins_the_prefetch_in_flight_and_no_block_is_pulled_twice() {
    const BIG: usize = 1 << 20;
    const N: u64 = 96;
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(
        &format!("tcp://127.0.0.1:{port}"),
        &["--peer-io-timeout-ms", "20000", "--peer-connections", "1"],
    );
    let keys: Vec<Key> = (0..N).map(key).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", BIG as u64)).unwrap().ns;
    for chunk in keys.chunks(8) {
        let data: Vec<Vec<u8>> = chunk
            .iter()
            .map(|k| block(k.0.router_hash(), BIG))
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        s.put(sns, chunk, &refs).unwrap();
    }
    let hits0 = tier(&mut s, "dram").hits;
    let mut c = dst.client();
    let ns = c.register(&spec("m", BIG as u64)).unwrap().ns;
    let r = act(
        &mut c,
        ns,
        &keys,
        &[(
            "kv.prefetch",
            serde_json::json!({"source_control_endpoint": format!("tcp://127.0.0.1:{port}"),
            "block_hashes": hashes(&keys), "execute_at": "now"}),
        )],
    );
    src.freeze();
    let ActionOutcome::Pulling(op) = &r[0].outcome else {
        panic!("{r:?}")
    };
    let pending = c
        .wait(op.op, 1)
        .unwrap()
        .results
        .iter()
        .filter(|k| **k == KeyOutcome::Pending)
        .count();
    assert!(
        pending > 0,
        "the prefetch finished before the get: the test proves nothing"
    );
    // The request's own hinted get, on another connection, while the prefetch is stalled.
    let sock = dst.socket().to_path_buf();
    let hint = kvnode_e2e::hint(port, &keys);
    let keys2 = keys.clone();
    let get = std::thread::spawn(move || {
        let mut c = Client::connect(&sock).unwrap();
        let ns = c.register(&spec("m", BIG as u64)).unwrap().ns;
        c.get_hinted(ns, &keys2, Some(&hint), Some(20_000)).unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    src.signal(libc::SIGCONT);
    let (pages, gop) = get.join().unwrap();
    let gop = gop.unwrap();
    assert_eq!(gop.state, OpState::Done, "{gop:?}");
    for (k, p) in keys.iter().zip(&pages) {
        assert_eq!(p.as_deref(), Some(block(k.0.router_hash(), BIG).as_slice()));
    }
    let prefetched = c.wait(op.op, 10_000).unwrap();
    assert_eq!(prefetched.state, OpState::Done, "{prefetched:?}");
    // Each block left the source once: the get pulled nothing of its own.
    assert_eq!(tier(&mut s, "dram").hits - hits0, N, "blocks served twice");
    eprintln!("{pending} of {N} blocks were in flight when the get joined");
}

#[test]
fn a_hinted_lookup_runs_the_envelopes_other_actions_and_reports_each() {
    let port = free_port();
    let src = peer_source(port, &[]);
    let dst = peer_dest(&format!("tcp://127.0.0.1:{port}"), &[]);
    let keys: Vec<Key> = (0..4).map(key).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", PAGE as u64)).unwrap().ns;
    put(&mut s, sns, 0..4);
    let (mut c, ns, _) = stocked(&dst, 2);
    let ep = format!("tcp://127.0.0.1:{port}");
    let hint = envelope(&[
        (
            "kv.fetch",
            // kv.fetch hashes are integers, as Dynamo's router writes them.
            serde_json::json!({"source_control_endpoint": ep,
                "block_hashes": keys.iter().map(|k| k.0.router_hash()).collect::<Vec<u64>>()}),
        ),
        (
            "kv.retain",
            serde_json::json!({"block_hashes": hashes(&keys[..2]), "ttl_seconds": 30}),
        ),
        ("kv.pin", serde_json::json!({"block_hashes": hashes(&keys)})),
    ]);
    let (n, op) = c.exists_hinted(ns, &keys, Some(&hint)).unwrap();
    assert_eq!(n, 2);
    let op = op.expect("the kv.fetch started a pull");
    assert_eq!(op.actions.len(), 2, "{op:?}");
    assert_eq!(
        (
            op.actions[0].action_type.as_str(),
            done_blocks(&op.actions[0])
        ),
        ("kv.retain", 2)
    );
    assert!(
        matches!(&op.actions[1].outcome, ActionOutcome::Refused { code: Refusal::Unsupported, message } if message.contains("\"kv.pin\"")),
        "{op:?}"
    );
    assert_eq!(tier(&mut c, "dram").retained_blocks, 2);
    let done = c.wait(op.op, 10_000).unwrap();
    assert_eq!(done.state, OpState::Done, "{done:?}");
    assert_eq!(c.exists(ns, &keys).unwrap(), 4);
}
