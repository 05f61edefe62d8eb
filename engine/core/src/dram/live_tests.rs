//! Unit tests of the live takeover image and its delta (state/live.rs): the tier rebuilt
//! from an image taken while serving plus the delta at the barrier is the tier as it is at
//! the barrier, slot for slot. Run: `cargo test --release -p kvnode-engine --lib dram::live_tests`.

use super::test_fixtures::*;
use super::*;

fn put(t: &DramTier, ns: u32, i: u32, len: u64) -> Option<Reserved> {
    let r = t
        .reserve(1, ns, &[key(i)], &[len])
        .unwrap()
        .remove(0)
        .ok()?;
    assert_eq!(
        t.commit_one(1, &r, None, false, Some(u64::from(i))),
        CommitStatus::Committed
    );
    Some(r)
}

/// Where each of `keys` is (offset, length, fingerprint), or `None`.
fn places(t: &DramTier, ns: u32, keys: &[u32]) -> Vec<Option<(u64, u64, Option<u64>)>> {
    let ks: Vec<Key> = keys.iter().map(|&i| key(i)).collect();
    let got = t.lease(ns, &ks).unwrap();
    let out = got
        .iter()
        .map(|g| g.map(|l| (l.extent.offset, l.extent.len, l.fingerprint)))
        .collect();
    let slots: Vec<SlotId> = got.iter().flatten().map(|l| l.slot).collect();
    t.release(&slots);
    out
}

/// A tier of 40 blocks; its live image; then, while "serving": a delete whose slot a new
/// block takes, more puts, a read (lease), and a namespace registered after the image.
fn served_through_an_image() -> (DramTier, Vec<u8>, u32, u32) {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    for i in 0..40 {
        put(&t, a, i, 60 << 10).unwrap();
    }
    let (image, st) = t.live_image().unwrap();
    assert_eq!(st.blocks, 40);
    let freed = places(&t, a, &[3])[0].unwrap().0;
    t.delete(a, &[key(3)]).unwrap();
    let reused = put(&t, a, 100, 60 << 10).unwrap();
    assert_eq!(
        reused.offset, freed,
        "the test wants the deleted block's slot reused"
    );
    for i in 101..110 {
        put(&t, a, i, 50 << 10).unwrap();
    }
    places(&t, a, &[5, 6, 7]);
    let b = t.register(&spec("b", 300 << 10)).unwrap().ns;
    for i in 200..203 {
        put(&t, b, i, 300 << 10).unwrap();
    }
    (t, image, a, b)
}

#[test]
fn the_image_and_the_delta_rebuild_the_tier_as_it_is_at_the_barrier() {
    let (t, image, a, b) = served_through_an_image();
    let r = DramTier::restore(&cfg(16 * MIB), Announcer::new(None), &image).unwrap();
    let delta = t.delta().unwrap();
    let named = r.apply_delta(&delta).unwrap();
    assert!(
        named < 20,
        "the delta names the changed slots only: {named}"
    );
    let ka: Vec<u32> = (0..40).chain(100..110).collect();
    assert_eq!(places(&r, a, &ka), places(&t, a, &ka));
    assert_eq!(
        places(&r, a, &[3])[0],
        None,
        "a block deleted during the build"
    );
    let rb = r.namespaces().iter().find(|n| n.2.model == "b").unwrap().0;
    assert_eq!(rb, b);
    let kb: Vec<u32> = (200..203).collect();
    assert_eq!(places(&r, b, &kb), places(&t, b, &kb));
    assert_eq!(r.blocks(), t.blocks());
    assert_eq!(r.snapshot().tier.bytes, t.snapshot().tier.bytes);
    assert_eq!(r.free_and_capacity(), t.free_and_capacity());
    // New blocks land in free slots, never on a block's.
    let taken: std::collections::HashSet<u64> = places(&r, a, &ka)
        .into_iter()
        .flatten()
        .map(|p| p.0)
        .collect();
    for i in 300..310 {
        let n = put(&r, a, i, 60 << 10).unwrap();
        assert!(
            !taken.contains(&n.offset),
            "slot of a block handed out again"
        );
    }
}

#[test]
fn without_the_delta_a_slot_reused_during_the_build_serves_another_blocks_bytes() {
    // What the delta prevents: the image alone still maps the deleted block to its old slot,
    // which now holds block 100's bytes.
    let (t, image, a, _) = served_through_an_image();
    let r = DramTier::restore(&cfg(16 * MIB), Announcer::new(None), &image).unwrap();
    let stale = places(&r, a, &[3])[0].expect("the image alone still has block 3");
    let now = places(&t, a, &[100])[0].unwrap();
    assert_eq!(stale.0, now.0, "block 3's slot holds block 100 now");
    assert_eq!(places(&r, a, &[100])[0], None, "and block 100 is unknown");
}

#[test]
fn a_delta_is_refused_when_tracking_stopped_or_the_tier_is_not_quiescent() {
    let (t, _, a, _) = served_through_an_image();
    let r = t
        .reserve(1, a, &[key(500)], &[100])
        .unwrap()
        .remove(0)
        .unwrap();
    assert!(t.delta().unwrap_err().to_string().contains("not quiescent"));
    t.abort(1, std::slice::from_ref(&r));
    t.stop_tracking();
    assert!(t.delta().unwrap_err().to_string().contains("no live image"));
}
