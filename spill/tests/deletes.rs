//! Deletes and clears survive a restart: the delete and clear markers in the spill log end
//! the blocks they name, in every file, through a clean stop, a stop without sealing, and
//! region reclaim; a block written again after its delete is kept.
//! Run: `cargo test --release -p kvnode-spill --test deletes`.

mod common;

use common::{TempDir, data, faulty};
use kvnode_spill::{
    FaultPlan, IoBuf, IoEngineKind, ReadOutcome, SpillConfig, SpillKey, SpillTier, WriteOutcome,
};
use proptest::prelude::*;
use std::collections::HashMap;

const NAMESPACES: [u128; 2] = [0xA, 0xB];

fn key(ns: u128, i: u64) -> SpillKey {
    let mut digest = [0u8; 32];
    digest[..8].copy_from_slice(&i.to_le_bytes());
    SpillKey {
        namespace: ns,
        digest,
        segment: 0,
    }
}

/// Two spill files (one per directory) of `regions` 1 MiB regions each.
fn open(dirs: &[TempDir; 2], regions: u64, seal: bool) -> SpillTier {
    let size = 4096 + regions * (1 << 20);
    let config = SpillConfig::builder()
        .dir(&dirs[0].0, size)
        .dir(&dirs[1].0, size)
        .engine(IoEngineKind::Uring)
        .region_size(1 << 20)
        .max_block_size(64 << 10)
        .queue_depth(8)
        .seal_on_shutdown(seal)
        .build()
        .unwrap();
    SpillTier::open(config).unwrap()
}

fn dirs() -> [TempDir; 2] {
    [TempDir::disk(), TempDir::disk()]
}

/// The bytes of version `v` of block `(ns, i)`.
fn bytes(ns: u128, i: u64, v: u64, len: usize) -> Vec<u8> {
    data((ns as u64) << 40 | i << 16 | v, len)
}

fn put(t: &SpillTier, ns: u128, i: u64, v: u64, len: usize) -> WriteOutcome {
    let done = t.write(key(ns, i), IoBuf::Vec(bytes(ns, i, v, len))).wait();
    done.result.expect("write")
}

/// What a read of `(ns, i)` returns: its bytes, or `None` on a miss.
fn get(t: &SpillTier, ns: u128, i: u64) -> Option<Vec<u8>> {
    let done = t.read(key(ns, i), IoBuf::Vec(Vec::new())).wait();
    match done.result.expect("read") {
        ReadOutcome::Hit { len } => {
            let IoBuf::Vec(mut v) = done.buf else {
                panic!("buffer kind changed")
            };
            v.truncate(len);
            Some(v)
        }
        _ => None,
    }
}

fn deletes_and_clears_stay_made(seal: bool) {
    let d = dirs();
    let t = open(&d, 8, seal);
    for ns in NAMESPACES {
        for i in 0..40 {
            put(&t, ns, i, 0, 5000 + i as usize * 100);
        }
    }
    // Deleted: A's 0..10; cleared: all of B; A's 5 written again after its delete.
    for i in 0..10 {
        assert!(t.delete(&key(0xA, i)));
    }
    assert!(!t.delete(&key(0xA, 1000)), "a key never written was held");
    assert_eq!(t.clear(Some(0xB)).len(), 40);
    put(&t, 0xA, 5, 1, 7000);
    drop(t);

    let t = open(&d, 8, true);
    let r = t.recovery();
    assert_eq!(r.blocks, 31, "{r:?}");
    // 10 deletes and 1 clear, each marked in both files.
    assert_eq!(r.files.iter().map(|f| f.markers).sum::<u64>(), 22, "{r:?}");
    assert_eq!(r.deleted, 50, "{r:?}");
    assert_eq!(t.stats().recovery_deleted, 50);
    for i in 0..40 {
        assert_eq!(get(&t, 0xB, i), None, "cleared block B/{i} came back");
        let want = match i {
            5 => Some(bytes(0xA, 5, 1, 7000)),
            0..10 => None,
            _ => Some(bytes(0xA, i, 0, 5000 + i as usize * 100)),
        };
        assert!(get(&t, 0xA, i) == want, "block A/{i} after the reopen");
    }
    // A clear of everything, then a third start: nothing is left.
    assert_eq!(t.clear(None).len(), 31);
    drop(t);
    let t = open(&d, 8, true);
    assert_eq!(t.recovery().blocks, 0, "{:?}", t.recovery());
    assert_eq!(get(&t, 0xA, 20), None);
}

#[test]
fn deletes_and_clears_stay_made_across_a_clean_stop() {
    deletes_and_clears_stay_made(true);
}

#[test]
fn deletes_and_clears_stay_made_across_a_stop_that_seals_nothing() {
    deletes_and_clears_stay_made(false);
}

#[test]
fn a_delete_marker_outlives_the_block_it_ends_through_region_reclaim() {
    // 3 regions of 1 MiB a file. The block goes into region 0 of its file, fillers close
    // region 0 of both files, so the delete's markers land in regions 1: every later start
    // must find the block gone while region 0 still holds it, and once region 0 is reclaimed
    // (oldest first) the marker goes with region 1 later, never before.
    let d = dirs();
    let t = open(&d, 3, true);
    put(&t, 0xA, 0, 0, 40_000);
    for i in 1..=48 {
        put(&t, 0xA, i, 0, 40_000);
    }
    assert!(t.delete(&key(0xA, 0)));
    drop(t);
    let mut evictions = 0;
    for round in 1..=8u64 {
        let t = open(&d, 3, round % 2 == 0);
        assert_eq!(get(&t, 0xA, 0), None, "deleted block back in round {round}");
        for i in 0..12 {
            put(&t, 0xA, round * 100 + i, 0, 40_000);
        }
        evictions += t.stats().evictions;
        drop(t);
    }
    let t = open(&d, 3, true);
    assert_eq!(get(&t, 0xA, 0), None);
    assert!(
        evictions > 0,
        "no region was reclaimed: the test proves nothing"
    );
    assert!(t.recovery().deleted <= 1, "{:?}", t.recovery());
}

#[test]
fn a_delete_marker_is_not_reclaimed_before_its_block_when_seals_finish_out_of_order() {
    // One file of 3 regions; 14 blocks of 64 KiB fill a region. Block 0 lies in region 0,
    // its delete marker in region 1, and region 0's seal is made to finish after region 1's
    // (its fsync is held back until a later one completes). Were regions reclaimed in the
    // order their seals finished, region 1 and the marker would go first while region 0
    // still holds the block, and the next start would serve the deleted block.
    let d = TempDir::disk();
    let config = |engine| {
        SpillConfig::builder()
            .dir(&d.0, 4096 + 3 * (1 << 20))
            .engine(engine)
            .region_size(1 << 20)
            .max_block_size(64 << 10)
            .queue_depth(8)
            .sync_interval(None)
            .build()
            .unwrap()
    };
    let late = faulty(FaultPlan {
        late_fsync: Some(0),
        ..FaultPlan::default()
    });
    let t = SpillTier::open(config(late)).unwrap();
    let len = 64 << 10;
    // Block 14 opens region 1 and starts region 0's seal.
    for i in 0..15 {
        put(&t, 0xA, i, 0, len);
    }
    assert!(t.delete(&key(0xA, 0)));
    let mut evicted = Vec::new();
    let mut i = 15;
    while evicted.is_empty() {
        assert!(i < 60, "no region reclaimed: {:?}", t.stats());
        evicted = put(&t, 0xA, i, 0, len).evicted;
        i += 1;
    }
    let first: Vec<u64> = (1..14).collect(); // region 0 less the deleted block
    let got: Vec<u64> = evicted
        .iter()
        .map(|k| u64::from_le_bytes(k.digest[..8].try_into().unwrap()))
        .collect();
    drop(t);
    let t = SpillTier::open(config(IoEngineKind::Uring)).unwrap();
    assert_eq!(
        get(&t, 0xA, 0),
        None,
        "the deleted block came back after the restart"
    );
    assert_eq!(
        got, first,
        "the first reclaim took a region other than the oldest"
    );
}

#[test]
fn what_a_markers_write_evicts_is_reported_by_take_evicted() {
    // A full tier reopened: every region is sealed, so the first marker reclaims one in each
    // file. No block write follows to report that eviction; `take_evicted` must.
    let d = dirs();
    let t = open(&d, 3, true);
    for i in 0..200 {
        put(&t, 0xA, i, 0, 40_000);
    }
    drop(t);
    let t = open(&d, 3, true);
    let held = t.keys();
    assert!(t.delete(&held[0]));
    t.sync().wait().unwrap();
    let evicted = t.take_evicted();
    assert!(!evicted.is_empty(), "no region reclaimed: {:?}", t.stats());
    assert!(evicted.iter().all(|k| !t.contains(k)));
    assert_eq!(t.keys().len() + evicted.len() + 1, held.len());
    assert!(t.take_evicted().is_empty(), "reported twice");
}

#[test]
fn deletes_and_clears_that_find_nothing_write_nothing() {
    // The attack: a client repeating deletes and clears of what it does not hold. Were each
    // to write a marker, they would fill the log and reclaim regions that hold other
    // tenants' blocks.
    let d = dirs();
    let t = open(&d, 3, true);
    for i in 0..20 {
        put(&t, 0xB, i, 0, 40_000);
    }
    for i in 0..10_000 {
        assert!(!t.delete(&key(0xA, i)));
        assert!(t.clear(Some(0xA)).is_empty());
    }
    t.sync().wait().unwrap();
    let s = t.stats();
    assert_eq!(
        (s.marks_written, s.evictions, s.blocks),
        (0, 0, 20),
        "{s:?}"
    );
    for i in 0..20 {
        assert!(get(&t, 0xB, i) == Some(bytes(0xB, i, 0, 40_000)));
    }
}

#[derive(Clone, Debug)]
enum Op {
    Put(usize, u64, usize),
    Delete(usize, u64),
    Clear(Option<usize>),
    Reopen(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..2usize, 0..24u64, 1..40_000usize).prop_map(|(n, i, l)| Op::Put(n, i, l)),
        3 => (0..2usize, 0..24u64).prop_map(|(n, i)| Op::Delete(n, i)),
        1 => proptest::option::of(0..2usize).prop_map(Op::Clear),
        1 => any::<bool>().prop_map(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Against a model of what was written, deleted and cleared: after every restart the
    /// tier holds exactly what it held before it (nothing deleted comes back, nothing kept is
    /// lost; only region reclaim removes blocks), each with the bytes last written.
    #[test]
    fn a_restart_holds_exactly_what_was_held_before_it(ops in proptest::collection::vec(op(), 1..120)) {
        let d = dirs();
        let mut t = open(&d, 3, true);
        let mut versions: HashMap<(u128, u64), (u64, usize)> = HashMap::new();
        let mut v = 0u64;
        for o in ops.into_iter().chain([Op::Reopen(true)]) {
            match o {
                Op::Put(n, i, len) => {
                    v += 1;
                    put(&t, NAMESPACES[n], i, v, len);
                    versions.insert((NAMESPACES[n], i), (v, len));
                }
                Op::Delete(n, i) => {
                    t.delete(&key(NAMESPACES[n], i));
                }
                Op::Clear(n) => {
                    t.clear(n.map(|n| NAMESPACES[n]));
                }
                Op::Reopen(seal) => {
                    // A marker takes room like a block and may reclaim a region: once the
                    // worker has placed the queued marks (a sync is handled after them), the
                    // index shows what their writes evicted.
                    t.sync().wait().unwrap();
                    let mut before = t.keys();
                    before.sort_unstable_by_key(|k| (k.namespace, k.digest));
                    drop(t);
                    t = open(&d, 3, seal);
                    let mut after = t.keys();
                    after.sort_unstable_by_key(|k| (k.namespace, k.digest));
                    prop_assert_eq!(&after, &before, "{:?}", t.recovery());
                    for k in &after {
                        let i = u64::from_le_bytes(k.digest[..8].try_into().unwrap());
                        let (ver, len) = versions[&(k.namespace, i)];
                        prop_assert!(get(&t, k.namespace, i) == Some(bytes(k.namespace, i, ver, len)));
                    }
                }
            }
        }
    }
}
