//! A put larger than free DRAM succeeds while the NVMe tier has room: the daemon takes it run
//! by run, each run waiting for demotion to make space, so the put proceeds at disk speed
//! instead of answering `NoSpace`. Real daemon, real spill file under /var/tmp.
//! Run: `cargo test --release -p kvnode-e2e --test spill_backpressure`.

use kvnode_client::kvnode_proto::client::PutStatus;
use kvnode_e2e::{Daemon, block, key, spec, spill_dir, tier};
use kvnode_proto::Key;

const BLOCK: usize = 256 << 10;
const BLOCKS: u64 = 1024;

#[test]
fn one_put_four_times_larger_than_dram_stores_every_block_via_nvme() {
    let dir = spill_dir("backpressure");
    let d = Daemon::start(&[
        "--dram",
        "64MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--spill-dir",
        dir.to_str().unwrap(),
        "--spill-size",
        "1GiB",
    ]);
    let mut c = d.client();
    let ns = c.register(&spec("bp", BLOCK as u64)).unwrap().ns;
    let keys: Vec<Key> = (0..BLOCKS).map(key).collect();
    let data: Vec<Vec<u8>> = (0..BLOCKS).map(|i| block(i, BLOCK)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let r = c.put(ns, &keys, &refs).unwrap();
    let stored = r.iter().filter(|s| **s == PutStatus::Stored).count();
    assert_eq!(stored, BLOCKS as usize, "statuses: {:?}", tally(&r));
    let dram = tier(&mut c, "dram");
    assert_eq!(
        dram.dropped, 0,
        "no block was evicted without a copy: {dram:?}"
    );
    // Every block reads back byte-identical (most from NVMe, promoted on get).
    for (i, ks) in keys.chunks(64).enumerate() {
        let pages = c.get(ns, ks).unwrap();
        for (j, p) in pages.iter().enumerate() {
            let n = (i * 64 + j) as u64;
            let same = p.as_deref() == Some(block(n, BLOCK).as_slice());
            assert!(
                same,
                "block {n}: {}",
                p.as_ref().map_or("missing", |_| "wrong bytes")
            );
        }
    }
    let dram = tier(&mut c, "dram");
    assert_eq!(
        dram.dropped, 0,
        "reading back dropped nothing either: {dram:?}"
    );
    let nvme = tier(&mut c, "nvme");
    assert!(nvme.promotions > 0, "reads came back from NVMe: {nvme:?}");
}

fn tally(r: &[PutStatus]) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for s in r {
        *m.entry(format!("{s:?}")).or_insert(0) += 1;
    }
    m
}

/// The default slab (64 MiB) with a spill tier: the spill region must fit a whole slab-sized
/// block plus its headers (it once panicked at start-up clamping to a 64 MiB maximum).
#[test]
fn a_spill_tier_starts_with_the_default_slab_size() {
    let dir = spill_dir("default-slab");
    let d = Daemon::start(&[
        "--dram",
        "256MiB",
        "--no-pin",
        "--spill-dir",
        dir.to_str().unwrap(),
        "--spill-size",
        "1GiB",
    ]);
    let mut c = d.client();
    let ns = c.register(&spec("slab", BLOCK as u64)).unwrap().ns;
    let r = c.put(ns, &[key(1)], &[block(1, BLOCK).as_slice()]).unwrap();
    assert_eq!(r, vec![PutStatus::Stored]);
    let nvme = tier(&mut c, "nvme");
    assert!(nvme.capacity_bytes > 900 << 20, "{nvme:?}");
}
