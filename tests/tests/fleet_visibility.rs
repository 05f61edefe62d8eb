//! What a router and a node's policy learn beyond puts (issue 40, the fleet): a block a
//! daemon pulls from a peer is announced in its KV events with the metadata its source
//! announced it with (so a router knows the destination now holds the prefix), and an
//! engine's `Touch` of the pages its GPU prefix cache served keeps them in the node's DRAM
//! (without it, the LRU ages a hot prefix's leading blocks first).
//! Run: `cargo test --release -p kvnode-e2e --test fleet_visibility`.

use std::collections::HashMap;

use dynamo_kv_router::zmq_wire::{RawKvEvent, decode_event_batch};
use kvnode_client::Client;
use kvnode_e2e::snapshot::snapshot_of;
use kvnode_e2e::{Daemon, block, free_port, key, peer_dest, peer_source, spec, temp_dir, tier};
use kvnode_proto::Key;
use kvnode_proto::client::{BlockMeta, PutStatus};

const PAGE: usize = 64 << 10;

fn tokens(i: u64) -> Vec<u32> {
    (0..16).map(|j| (i * 16 + j) as u32 + 7).collect()
}

fn ns_spec() -> kvnode_proto::NamespaceSpec {
    kvnode_proto::NamespaceSpec {
        page_size: 16,
        ..spec("fleet", PAGE as u64)
    }
}

/// Puts blocks `ids`, chained, with token metadata when `meta` (announced) or without.
fn put(c: &mut Client, ns: u32, ids: &[u64], meta: bool) {
    let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
    let data: Vec<Vec<u8>> = ids.iter().map(|&i| block(i, PAGE)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let metas = ids
        .iter()
        .map(|&i| {
            meta.then(|| BlockMeta {
                tokens: tokens(i),
                parent: i.checked_sub(1).map(|p| key(p).0),
            })
        })
        .collect();
    let r = c.put_with_meta(ns, &keys, &refs, metas).unwrap();
    assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
}

/// Every `BlockStored` in `endpoint`'s residency snapshot: router hash -> (tokens, parent).
fn announced(endpoint: &str) -> HashMap<u64, (Vec<u32>, Option<u64>)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (batches, _) = rt.block_on(snapshot_of(endpoint));
    let mut out = HashMap::new();
    for b in batches {
        for e in decode_event_batch(&b)
            .expect("a Dynamo-decodable batch")
            .events
        {
            if let RawKvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } = e
            {
                assert_eq!(block_hashes.len(), 1, "one block per store here");
                out.insert(
                    block_hashes[0].into_u64(),
                    (
                        token_ids,
                        parent_block_hash.map(dynamo_kv_router::zmq_wire::BlockHashValue::into_u64),
                    ),
                );
            }
        }
    }
    out
}

#[test]
fn a_pulled_block_is_announced_with_its_sources_tokens_and_parent() {
    let port = free_port();
    let sdir = temp_dir("fleet-src-ev");
    let sev = format!("ipc://{}", sdir.join("ev.sock").display());
    let src = peer_source(port, &["--events", &sev]);
    let mut s = src.client();
    let sns = s.register(&ns_spec()).unwrap().ns;
    // 0..6 announced by the source (with tokens); 6..8 stored without metadata.
    put(&mut s, sns, &[0, 1, 2, 3, 4, 5], true);
    put(&mut s, sns, &[6, 7], false);

    let ddir = temp_dir("fleet-dst-ev");
    let ev = format!("ipc://{}", ddir.join("ev.sock").display());
    let replay = format!("ipc://{}", ddir.join("replay.sock").display());
    let dst = peer_dest(
        "127.0.0.0/8",
        &["--events", &ev, "--events-replay", &replay],
    );
    let mut c = dst.client();
    let ns = c.register(&ns_spec()).unwrap().ns;
    let keys: Vec<Key> = (0..8).map(key).collect();
    let hint = serde_json::json!({
        "source_control_endpoint": format!("tcp://127.0.0.1:{port}"),
        "block_hashes": (0..8).map(|i| key(i).0.router_hash()).collect::<Vec<_>>(),
    })
    .to_string();
    let (lease, _op) = c
        .get_lease_hinted(ns, &keys, Some(&hint), Some(30_000))
        .unwrap();
    assert_eq!(lease.leading_hits(), 8, "the whole prefix was pulled");
    c.release(lease.id).unwrap();
    assert_eq!(tier(&mut c, "dram").blocks, 8);

    let got = announced(&replay);
    for i in 0..6u64 {
        let h = key(i).0.router_hash();
        let want_parent = i.checked_sub(1).map(|p| key(p).0.router_hash());
        assert_eq!(
            got.get(&h),
            Some(&(tokens(i), want_parent)),
            "pulled block {i} is announced by the destination as its source announced it"
        );
    }
    for i in 6..8u64 {
        assert!(
            !got.contains_key(&key(i).0.router_hash()),
            "block {i} had no metadata at its source: nothing to announce"
        );
    }
    assert_eq!(got.len(), 6, "{got:?}");
}

#[test]
fn touching_the_pages_an_engine_holds_on_its_gpu_keeps_them_in_dram() {
    // 8 MiB of DRAM: about a hundred 64 KiB blocks.
    let d = Daemon::start(&["--dram", "8MiB", "--no-pin"]);
    let mut c = d.client();
    let ns = c.register(&ns_spec()).unwrap().ns;
    let touched: Vec<u64> = (0..4).collect();
    let untouched: Vec<u64> = (100..104).collect();
    put(&mut c, ns, &touched, false);
    put(&mut c, ns, &untouched, false);
    let tk: Vec<Key> = touched.iter().map(|&i| key(i)).collect();
    let uk: Vec<Key> = untouched.iter().map(|&i| key(i)).collect();
    // Other requests' blocks stream through; the engine serves `touched` from its GPU
    // between them and touches those pages.
    for batch in 0..64u64 {
        let ids: Vec<u64> = (0..8).map(|j| 1000 + batch * 8 + j).collect();
        put(&mut c, ns, &ids, false);
        assert_eq!(c.touch(ns, &tk).unwrap(), 4, "batch {batch}");
    }
    let dram = tier(&mut c, "dram");
    assert!(
        dram.evictions > 2 * dram.blocks,
        "the tier turned over: {dram:?}"
    );
    assert_eq!(dram.touched, 64 * 4);
    assert_eq!(c.exists(ns, &tk).unwrap(), 4, "the touched prefix stayed");
    assert_eq!(c.exists(ns, &uk).unwrap(), 0, "the untouched one aged out");
    // A touch counts the leading run held: nothing past the first miss.
    let mixed = [tk[0], uk[0], tk[1]];
    assert_eq!(c.touch(ns, &mixed).unwrap(), 1);
    // An unknown namespace is an error, not a crash; the daemon answers on.
    assert!(c.touch(ns + 77, &tk).is_err());
    assert_eq!(c.exists(ns, &tk).unwrap(), 4);
}
