//! KV events from a real daemon over real ZMQ on loopback, judged by Dynamo's own parser.
//!
//! A property test drives random put / evict (filler puts) / demote / promote (get) /
//! delete / clear sequences against a daemon with a spill tier, decodes every batch with
//! `dynamo_kv_router::zmq_wire::decode_event_batch`, normalizes it with `ZmqEventNormalizer`,
//! replays the result into per-tier sets (failing on a double store or a remove without a
//! store), and requires the sets to equal the daemon's real residency. The live subscriber
//! joins late and recovers the batches it missed through the replay socket.
//! Run: `cargo test --release -p kvnode-e2e --test events`.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dynamo_kv_router::protocols::{
    BlockHashOptions, KvCacheEventData, StorageTier, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{RawKvEvent, ZmqEventNormalizer, decode_event_batch};
use dynamo_kv_router::{LocalBlockHash, compute_block_hash_for_seq};
use kvnode_client::Client;
use kvnode_client::kvnode_proto::client::BlockMeta;
use kvnode_e2e::{Daemon, SpillDir, block, key, spill_dir, temp_dir};
use kvnode_proto::{Key, NamespaceSpec};
use proptest::prelude::*;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const PAGE: u32 = 4;
const BLOCK: usize = 256 << 10;
const SALT: &str = "tenant-a";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tokens(i: u64) -> Vec<u32> {
    (0..PAGE).map(|j| (i * 4 + u64::from(j)) as u32).collect()
}

fn meta(i: u64) -> BlockMeta {
    BlockMeta {
        tokens: tokens(i),
        parent: i.checked_sub(1).map(|p| key(p).0),
    }
}

fn ns_spec() -> NamespaceSpec {
    NamespaceSpec {
        model: "events".into(),
        page_size: PAGE,
        tenant_salt: SALT.into(),
        segments: vec![BLOCK as u64],
        ..NamespaceSpec::default()
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// Put blocks `start..start+n` of the chain.
    Put(u64, u64),
    /// Put 80 filler blocks (more than DRAM holds): earlier blocks are demoted.
    Fill,
    /// Get blocks `start..start+n` (promotes spilled ones).
    Get(u64, u64),
    Delete(u64),
    ClearAll,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..40u64, 1..8u64).prop_map(|(s, n)| Step::Put(s, n)),
        2 => Just(Step::Fill),
        3 => (0..40u64, 1..8u64).prop_map(|(s, n)| Step::Get(s, n)),
        1 => (0..40u64).prop_map(Step::Delete),
        1 => Just(Step::ClearAll),
    ]
}

struct Fixture {
    daemon: Daemon,
    events: String,
    replay: String,
    /// Kept only to remove the spill files when the fixture (daemon first) is dropped.
    _dir: SpillDir,
}

fn start() -> Fixture {
    let dir = spill_dir(&format!("events-{}", free_port()));
    // The events sockets: ipc paths in a private directory, mode 0600 (the default).
    let sockets = temp_dir("events-ipc");
    let events = format!("ipc://{}", sockets.join("ev.sock").display());
    let replay = format!("ipc://{}", sockets.join("replay.sock").display());
    let daemon = Daemon::start_spilling(
        &dir,
        "48MiB",
        &[
            "--events",
            &events,
            "--events-replay",
            &replay,
            "--dp-rank",
            "0",
        ],
    );
    Fixture {
        daemon,
        events,
        replay,
        _dir: dir,
    }
}

fn put(c: &mut Client, ns: u32, ids: &[u64]) {
    let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
    let data: Vec<Vec<u8>> = ids.iter().map(|&i| block(i, 4096)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let metas = ids.iter().map(|&i| Some(meta(i))).collect();
    c.put_with_meta(ns, &keys, &refs, metas).unwrap();
}

fn apply(c: &mut Client, ns: u32, s: &Step, filler: &mut u64) {
    match *s {
        Step::Put(a, n) => put(c, ns, &(a..a + n).collect::<Vec<_>>()),
        Step::Fill => {
            for _ in 0..20 {
                let ids: Vec<u64> = (*filler..*filler + 4).collect();
                *filler += 4;
                put(c, ns, &ids);
            }
        }
        Step::Get(a, n) => {
            let keys: Vec<Key> = (a..a + n).map(key).collect();
            for (i, g) in (a..).zip(c.get(ns, &keys).unwrap()) {
                if let Some(g) = g {
                    assert_eq!(g, block(i, 4096), "block {i} bytes");
                }
            }
        }
        Step::Delete(i) => {
            c.delete(ns, &[key(i)]).unwrap();
        }
        Step::ClearAll => {
            c.clear(None).unwrap();
        }
    }
}

/// Waits until the demoter is idle: nothing in flight in either tier (DRAM's count drops
/// inside the tier lock, the NVMe tier's after the demotion's last event) and no demotion
/// started for 50 ms, ten of the demoter's 5 ms ticks (it starts one within a tick whenever
/// free DRAM is below its watermark).
fn settle(c: &mut Client) {
    let t0 = Instant::now();
    let mut quiet_since: Option<(Instant, u64)> = None;
    loop {
        let s = c.stats().unwrap();
        let demotions = s.tiers[0].demotions;
        if s.tiers.iter().all(|t| t.in_flight == 0) {
            match quiet_since {
                Some((t, d)) if d == demotions => {
                    if t.elapsed() >= Duration::from_millis(50) {
                        return;
                    }
                }
                _ => quiet_since = Some((Instant::now(), demotions)),
            }
        } else {
            quiet_since = None;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "demotions still running after 20 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether a published batch announces the store of block `id` (its router hash).
fn stores(payload: &[u8], id: u64) -> bool {
    decode_event_batch(payload).is_ok_and(|b| {
        b.events.iter().any(|e| {
            matches!(e, RawKvEvent::BlockStored { block_hashes, .. } if block_hashes.iter().any(|h| h.into_u64() == id))
        })
    })
}

/// Replays every published batch, polling until the store of `marker` is among them: events
/// are published in submission order, so every event submitted before it is there too.
fn replay_through(rt: &tokio::runtime::Runtime, endpoint: &str, marker: u64) -> Vec<(u64, Bytes)> {
    let t0 = Instant::now();
    loop {
        let all = rt.block_on(replay_from(endpoint, 0));
        if all.iter().any(|(_, p)| stores(p, marker)) {
            return all;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the store of {marker} was not published within 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

async fn replay_from(endpoint: &str, start: u64) -> Vec<(u64, Bytes)> {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answers")
            .unwrap();
        let seq: [u8; 8] = m.get(1).unwrap()[..].try_into().unwrap();
        if i64::from_be_bytes(seq) == -1 {
            return out;
        }
        out.push((u64::from_be_bytes(seq), m.get(2).unwrap().clone()));
    }
}

/// Per-tier residency as the router sees it after replaying every batch in order.
#[derive(Default, Debug)]
struct RouterView {
    tiers: BTreeMap<String, HashSet<u64>>,
}

impl RouterView {
    fn apply_batch(&mut self, payload: &[u8], norm: &mut ZmqEventNormalizer, id: &mut u64) {
        let batch = decode_event_batch(payload).expect("dynamo decodes every batch");
        assert_eq!(batch.data_parallel_rank, Some(0));
        for raw in batch.events {
            *id += 1;
            let placed = norm
                .normalize(raw, *id, WorkerWithDpRank::new(1, 0))
                .expect("normalizer keeps every event");
            if matches!(placed.event.data, KvCacheEventData::Cleared) {
                // A clear carries no medium: it empties every tier.
                self.tiers.clear();
                continue;
            }
            let tier = match placed.placement.tier {
                StorageTier::HostPinned => "dram",
                StorageTier::Disk => "nvme",
                other => panic!("unexpected tier {other:?}"),
            }
            .to_owned();
            match placed.event.data {
                KvCacheEventData::Stored(s) => {
                    for b in &s.blocks {
                        let h = b.block_hash.0;
                        let want: Vec<LocalBlockHash> = compute_block_hash_for_seq(
                            &tokens(h),
                            PAGE,
                            BlockHashOptions {
                                block_mm_infos: None,
                                lora_name: None,
                                cache_namespace: Some(SALT),
                                is_eagle: None,
                            },
                        );
                        assert_eq!(vec![b.tokens_hash], want, "salted tokens hash of {h}");
                        assert_eq!(s.parent_hash.map(|p| p.0), h.checked_sub(1));
                        let set = self.tiers.entry(tier.clone()).or_default();
                        assert!(set.insert(h), "double store of {h} in {tier}");
                    }
                }
                KvCacheEventData::Removed(r) => {
                    for h in r.block_hashes {
                        let set = self.tiers.entry(tier.clone()).or_default();
                        assert!(
                            set.remove(&h.0),
                            "remove of {} without a store in {tier}",
                            h.0
                        );
                    }
                }
                KvCacheEventData::Cleared => unreachable!("handled above"),
            }
        }
    }

    fn count(&self, tier: &str) -> usize {
        self.tiers.get(tier).map_or(0, HashSet::len)
    }
}

fn run_case(steps: &[Step]) {
    let fx = start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut c = fx.daemon.client();
    let ns = c.register(&ns_spec()).unwrap().ns;
    let mut filler = 1000;
    // The first half runs before any subscriber exists: those batches only replay can give.
    let (early, late) = steps.split_at(steps.len() / 2);
    for s in early {
        apply(&mut c, ns, s, &mut filler);
    }
    settle(&mut c);
    let mut sub = rt.block_on(async {
        let mut s = SubSocket::new();
        s.connect(&fx.events).await.unwrap();
        s.subscribe("").await.unwrap();
        s
    });
    // The subscription is in force once a batch arrives: put probe blocks until one does.
    let mut probes = Vec::new();
    let mut live: Vec<u64> = Vec::new();
    let t0 = Instant::now();
    while live.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the subscriber got nothing in 10 s"
        );
        let p = 7000 + probes.len() as u64;
        put(&mut c, ns, &[p]);
        probes.push(p);
        let got = rt
            .block_on(async { tokio::time::timeout(Duration::from_millis(50), sub.recv()).await });
        if let Ok(Ok(m)) = got {
            live.push(u64::from_be_bytes(
                m.get(1).unwrap()[..].try_into().unwrap(),
            ));
        }
    }
    for s in late {
        apply(&mut c, ns, s, &mut filler);
    }
    // A final put: the marker whose publication proves every earlier event published.
    put(&mut c, ns, &[5000]);
    settle(&mut c);
    live.extend(rt.block_on(async {
        let mut seqs = Vec::new();
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            assert_eq!(m.len(), 3, "[topic, seq, payload]");
            seqs.push(u64::from_be_bytes(
                m.get(1).unwrap()[..].try_into().unwrap(),
            ));
        }
        seqs
    }));
    // Recover what the subscriber missed (it joined late) from the replay socket.
    let all = replay_through(&rt, &fx.replay, 5000);
    let seqs: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (0..all.len() as u64).collect::<Vec<_>>(), "no gaps");
    assert!(live.iter().all(|s| seqs.contains(s)));
    let mut view = RouterView::default();
    let mut norm = ZmqEventNormalizer::new(PAGE);
    let mut id = 0;
    for (_, p) in &all {
        view.apply_batch(p, &mut norm, &mut id);
    }
    let stats = c.stats().unwrap();
    assert_eq!(
        view.count("dram") as u64,
        stats.tiers[0].blocks,
        "DRAM residency"
    );
    assert_eq!(
        view.count("nvme") as u64,
        stats.tiers[1].blocks,
        "NVMe residency"
    );
    let union: HashSet<u64> = view.tiers.values().flatten().copied().collect();
    let mut all_ids: Vec<u64> = (0..48)
        .chain(1000..filler)
        .chain([5000])
        .chain(probes)
        .collect();
    all_ids.sort_unstable();
    for i in all_ids {
        let present = c.exists(ns, &[key(i)]).unwrap() == 1;
        assert_eq!(
            present,
            union.contains(&i),
            "block {i}: daemon vs router view"
        );
    }
    drop(c);
    drop(fx);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]
    #[test]
    fn replayed_events_equal_the_daemons_residency_per_tier(
        steps in proptest::collection::vec(step(), 4..14)
    ) {
        run_case(&steps);
    }
}

#[test]
fn demotion_promotion_and_clear_reach_the_router_exactly() {
    run_case(&[
        Step::Put(0, 8),
        Step::Fill,
        Step::Get(0, 4),
        Step::Delete(5),
        Step::Put(8, 4),
        Step::Fill,
        Step::Get(0, 12),
        Step::ClearAll,
        Step::Put(0, 3),
        Step::Fill,
    ]);
}

/// The minimal input of the "remove of N without a store in nvme" failure (issue 15): clears
/// that land while demotions are finishing. Fixed at the source (residency.rs publishes under
/// the clear epoch's lock; the NVMe map announces removals and stores under one lock); the
/// unit tests in engine/core/src/residency/record.rs force the interleavings.
#[test]
fn clears_racing_demotions_never_publish_an_orphan_removal() {
    use Step::{ClearAll, Fill, Get, Put};
    for _ in 0..3 {
        run_case(&[
            ClearAll,
            Fill,
            Get(37, 1),
            Put(2, 2),
            Fill,
            Fill,
            Fill,
            Get(27, 2),
            Put(17, 5),
            ClearAll,
            Fill,
            Get(19, 7),
            ClearAll,
        ]);
    }
}
