//! Gets larger than the DRAM tier, with most pages on NVMe only: served in prefix order
//! (every page, in order) or refused with `TooLarge` and the number of leading pages that
//! can be leased now; never a result whose head is missing while its tail is served.
//! Real daemons, real spill files under /var/tmp, a DRAM tier (16 MiB) four times smaller
//! than the get (200 pages of 256 KiB = 50 MiB), the last pages put still in DRAM.
//! Run: `cargo test --release -p kvnode-e2e --test spill_prefix`.

use std::os::fd::AsFd;

use kvnode_client::{Client, ClientError};
use kvnode_e2e::shm::Shm;
use kvnode_e2e::{
    Daemon, SpillDir, block, fill_and_settle, free_port, hint, key, peer_dest, spec, spill_dir,
    tier,
};
use kvnode_proto::Key;
use kvnode_proto::pull::{KeyOutcome, OpState};

const BLOCK: usize = 256 << 10;
/// Four times the 16 MiB DRAM tier.
const BLOCKS: u64 = 200;

fn filled(tag: &str, extra: &[&str]) -> (SpillDir, Daemon, Client, u32) {
    let dir = spill_dir(tag);
    let d = Daemon::start_spilling(&dir, "96MiB", extra);
    let mut c = d.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    fill_and_settle(&mut c, ns, BLOCKS, BLOCK);
    let dram = tier(&mut c, "dram");
    assert_eq!(dram.dropped, 0, "every evicted block was demoted: {dram:?}");
    assert!(
        dram.blocks < BLOCKS / 2,
        "most pages are on NVMe only: {dram:?}"
    );
    (dir, d, c, ns)
}

fn all_keys() -> Vec<Key> {
    (0..BLOCKS).map(key).collect()
}

fn no_lease_left(c: &mut Client) {
    let dram = tier(c, "dram");
    assert_eq!(dram.leases, 0, "no lease outlives the get: {dram:?}");
    assert_eq!(
        dram.reserved, 0,
        "no promotion slot is left reserved: {dram:?}"
    );
}

#[test]
fn inline_get_larger_than_dram_streams_every_page_in_order() {
    let (dir, d, mut c, ns) = filled("prefix-inline", &[]);
    let before = tier(&mut c, "nvme").promotions;
    let got = c.get(ns, &all_keys()).unwrap();
    assert_eq!(got.len(), BLOCKS as usize);
    for (i, g) in got.iter().enumerate() {
        assert_eq!(
            g.as_deref(),
            Some(block(i as u64, BLOCK).as_slice()),
            "page {i} of an inline get larger than DRAM"
        );
    }
    // The same through caller buffers (the client reads the streamed payload in place).
    let mut bufs: Vec<Vec<u8>> = (0..BLOCKS).map(|_| vec![0u8; BLOCK]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let lens = c.get_into(ns, &all_keys(), &mut dst).unwrap();
    assert!(lens.iter().all(|l| *l == Some(BLOCK as u64)), "{lens:?}");
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            b.as_slice(),
            block(i as u64, BLOCK).as_slice(),
            "buffer {i}"
        );
    }
    let nvme = tier(&mut c, "nvme");
    assert!(
        nvme.promotions >= before + BLOCKS / 2,
        "the head was promoted from NVMe: {nvme:?}"
    );
    no_lease_left(&mut c);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn get_to_region_larger_than_dram_copies_every_page_in_order() {
    let (dir, d, mut c, ns) = filled("prefix-region", &[]);
    let mut shm = Shm::new("kvnode-test-prefix", BLOCKS as usize * BLOCK);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    let offsets: Vec<u64> = (0..BLOCKS).map(|i| i * BLOCK as u64).collect();
    let lens = vec![BLOCK as u64; BLOCKS as usize];
    let got = c
        .get_to_region(ns, &all_keys(), region, &offsets, &lens)
        .unwrap();
    assert!(got.iter().all(|l| *l == Some(BLOCK as u64)), "{got:?}");
    let bytes = shm.bytes();
    for i in 0..BLOCKS as usize {
        assert!(
            bytes[i * BLOCK..(i + 1) * BLOCK] == block(i as u64, BLOCK)[..],
            "page {i} in the region"
        );
    }
    no_lease_left(&mut c);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lease_get_larger_than_dram_is_refused_with_the_leasable_prefix_then_split() {
    let (dir, d, mut c, ns) = filled("prefix-lease", &[]);
    let keys = all_keys();
    let leasable = match c.get_lease(ns, &keys) {
        Err(ClientError::TooLarge { leasable, message }) => {
            assert!(message.contains("lease those"), "{message}");
            leasable as usize
        }
        other => panic!("a lease get of 4x DRAM must be refused as TooLarge: {other:?}"),
    };
    assert!(
        leasable > 0 && leasable < keys.len(),
        "leasable {leasable} of {}",
        keys.len()
    );
    no_lease_left(&mut c);
    // The leading part it named is leased whole.
    let part = c.get_lease(ns, &keys[..leasable]).unwrap();
    assert_eq!(part.leading_hits(), leasable, "{part:?}");
    for (i, e) in part.extents.iter().enumerate() {
        let e = e.expect("leased");
        assert_eq!(
            c.arena().read(e),
            block(i as u64, BLOCK).as_slice(),
            "page {i}"
        );
    }
    c.release(part.id).unwrap();
    // The client's split reads every page, in order.
    let mut seen = 0usize;
    let mut parts = 0;
    c.get_lease_each(ns, &keys, |at, lease, arena| {
        assert_eq!(at, seen, "parts come in key order");
        parts += 1;
        for (j, e) in lease.extents.iter().enumerate() {
            let e = e.expect("every page of a part is leased");
            assert_eq!(
                arena.read(e),
                block((at + j) as u64, BLOCK).as_slice(),
                "page {}",
                at + j
            );
        }
        seen += lease.extents.len();
    })
    .unwrap();
    assert_eq!(seen, keys.len());
    assert!(parts > 1, "the get was split");
    no_lease_left(&mut c);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn peer_source_serves_a_pull_larger_than_its_dram_in_order() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let adv = format!("tcp://{listen}");
    let (dir, src, mut sc, sns) = filled(
        "prefix-peer",
        &[
            "--peer-listen",
            &listen,
            "--advertise",
            &adv,
            kvnode_e2e::KEYLESS,
        ],
    );
    let _ = sns;
    let dst = peer_dest(&adv, &[]);
    let mut c = dst.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    let keys = all_keys();
    let (pages, op) = c
        .get_hinted(ns, &keys, Some(&hint(port, &keys)), Some(30_000))
        .unwrap();
    let op = op.expect("a hinted get reports its pull");
    assert_eq!(
        op.state,
        OpState::Done,
        "{op:?}\nsource log:\n{}",
        src.log()
    );
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::Pulled),
        "every page pulled: {op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(block(i as u64, BLOCK).as_slice()),
            "page {i}"
        );
    }
    no_lease_left(&mut sc);
    drop(src);
    let _ = std::fs::remove_dir_all(&dir);
}
