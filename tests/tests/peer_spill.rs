//! A source whose blocks were demoted to its NVMe spill tier still answers pulls: it
//! promotes them into DRAM, leases and sends them. Real daemons, real spill files under
//! /var/tmp. Run: `cargo test --release -p kvnode-e2e --test peer_spill`.

use std::time::{Duration, Instant};

use kvnode_client::kvnode_proto::client::PutStatus;
use kvnode_e2e::{Daemon, block, free_port, hint, key, peer_dest, spec, spill_dir, tier};
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
    let src = Daemon::start_spilling(
        &dir,
        "96MiB",
        &["--peer-listen", &listen, "--advertise", &adv],
    );
    let mut sc = src.client();
    let sns = sc.register(&spec("m", BLOCK as u64)).unwrap().ns;
    for chunk in (0..BLOCKS).collect::<Vec<_>>().chunks(4) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, BLOCK)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let r = sc.put(sns, &keys, &refs).unwrap();
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    }
    let t0 = Instant::now();
    while tier(&mut sc, "dram").in_flight > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "demotions never finished"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
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
    drop(src);
    let _ = std::fs::remove_dir_all(&dir);
}
