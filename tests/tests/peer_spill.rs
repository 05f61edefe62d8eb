//! A source whose blocks were demoted to its NVMe spill tier still answers pulls: it
//! promotes them into DRAM, leases and sends them. Real daemons, real spill files under
//! /var/tmp. Run: `cargo test --release -p kvnode-e2e --test peer_spill`.

use std::time::{Duration, Instant};

use kvnode_e2e::peerstats::assert_pulled_over_ucx;
use kvnode_e2e::{block, free_port, hint, key, peer_dest, peer_spilling, spec, spill_dir, tier};
use kvnode_proto::Key;
use kvnode_proto::pull::{KeyOutcome, OpState};

const BLOCK: usize = 256 << 10;
/// 16 MiB of DRAM holds 64 such blocks; 200 is three times that.
const BLOCKS: u64 = 200;
/// Pulled keys: all among the first `BLOCKS - 64`, which cannot still be in DRAM.
const PULLED: u64 = 24;

#[test]
fn source_promotes_nvme_only_blocks_and_sends_them_byte_identical() {
    let dir = spill_dir("peer-spill");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let adv = format!("tcp://{listen}");
    let src = peer_spilling(
        &dir,
        "96MiB",
        &[
            "--peer-listen",
            &listen,
            "--advertise",
            &adv,
            kvnode_e2e::KEYLESS,
        ],
    );
    let mut sc = src.client();
    let sns = sc.register(&spec("m", BLOCK as u64)).unwrap().ns;
    kvnode_e2e::fill_and_settle(&mut sc, sns, BLOCKS, BLOCK);
    let dram = tier(&mut sc, "dram");
    assert_eq!(dram.dropped, 0, "every evicted block was demoted: {dram:?}");
    assert!(dram.demotions >= BLOCKS - 64, "{dram:?}");
    let promoted_before = tier(&mut sc, "nvme").promotions;

    let dst = peer_dest(&adv, &[]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    let keys: Vec<Key> = (0..PULLED).map(key).collect();
    let (pages, op) = c
        .get_hinted(ns, &keys, Some(&hint(port, &keys)), Some(10_000))
        .unwrap();
    let op = op.unwrap();
    assert_eq!(
        op.state,
        OpState::Done,
        "{op:?}\nsource stats: {:?}\nsource log:\n{}",
        sc.stats().map(|s| s.tiers),
        src.log()
    );
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::Pulled),
        "{op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, BLOCK).as_slice()),
            "page {i} differs"
        );
    }
    let nvme = tier(&mut sc, "nvme");
    assert!(
        nvme.promotions >= promoted_before + PULLED,
        "the source promoted the pulled blocks from NVMe: {nvme:?}"
    );
    assert_eq!(
        tier(&mut sc, "dram").leases,
        0,
        "no lease outlives the pull"
    );
    assert_pulled_over_ucx(&dst, &src);
    drop(src);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The destination's own NVMe comes before any peer: a hinted get or exists whose keys were
/// demoted to this node's spill tier answers from there at once, even though the hinted
/// peer is frozen (SIGSTOP: it accepts connections but never answers), and pulls only
/// true misses.
#[test]
fn hinted_get_serves_the_destinations_own_nvme_blocks_without_waiting_for_a_frozen_peer() {
    let dir = spill_dir("hint-own-nvme");
    let port = free_port();
    let src = kvnode_e2e::peer_source(port, &[]);
    src.freeze();
    let peers = format!("tcp://127.0.0.1:{port}");
    let dst = peer_spilling(&dir, "96MiB", &["--peers", &peers]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    kvnode_e2e::fill_and_settle(&mut c, ns, BLOCKS, BLOCK);
    let promoted_before = tier(&mut c, "nvme").promotions;
    let keys: Vec<Key> = (0..PULLED).map(key).collect();
    let declared = c.timeouts().unwrap();
    let declared_s = declared.base_s + declared.per_page_s * PULLED as f64;

    let t = Instant::now();
    let (n, op) = c
        .exists_hinted(ns, &keys, Some(&hint(port, &keys)))
        .unwrap();
    let exists_took = t.elapsed();
    assert_eq!(n, PULLED as u32);
    let op = op.unwrap();
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::HitLocal),
        "{op:?}"
    );

    let t = Instant::now();
    let (pages, op) = c
        .get_hinted(ns, &keys, Some(&hint(port, &keys)), None)
        .unwrap();
    let get_took = t.elapsed();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::HitLocal),
        "{op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, BLOCK).as_slice()),
            "page {i}"
        );
    }
    assert!(
        tier(&mut c, "nvme").promotions >= promoted_before + PULLED,
        "the keys were promoted from this node's NVMe"
    );
    // Well under the declared prefetch timeout (the old lookup waited for the frozen peer
    // until its connect timeout, then promoted).
    let bound = Duration::from_secs_f64(declared_s / 4.0);
    assert!(
        exists_took < bound,
        "hinted exists took {exists_took:?} (declared {declared_s} s)"
    );
    assert!(
        get_took < bound,
        "hinted get took {get_took:?} (declared {declared_s} s)"
    );
    assert_eq!(
        dst.client().stats().unwrap().tiers[0].reserved,
        0,
        "no pull slot was reserved"
    );
    eprintln!(
        "own-NVMe hinted exists {exists_took:?}, get {get_took:?}, declared timeout {declared_s:.2} s"
    );
    drop(src);
}
