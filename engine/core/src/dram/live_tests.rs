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
    new_blocks_land_in_free_slots(&r, a, &ka, 300..310);
}

/// Puts blocks `ids` into namespace `a` of `r` until the tier is full: none lands on the slot
/// of a block `held` names.
fn new_blocks_land_in_free_slots(r: &DramTier, a: u32, held: &[u32], ids: std::ops::Range<u32>) {
    let taken: std::collections::HashSet<u64> = places(r, a, held)
        .into_iter()
        .flatten()
        .map(|p| p.0)
        .collect();
    let mut landed = 0;
    for i in ids {
        let Some(n) = put(r, a, i, 60 << 10) else {
            break;
        };
        assert!(
            !taken.contains(&n.offset),
            "slot of a block handed out again"
        );
        landed += 1;
    }
    assert!(landed > 0, "no new block found room: nothing was checked");
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

/// A tier of 40 blocks, its live image, the successor's tier built from it, and `churn`
/// puts made "while the successor builds" (each takes a slot the image has free).
fn built_while_putting(churn: u32) -> (DramTier, DramTier, u32) {
    let t = DramTier::new(&cfg(256 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    for i in 0..40 {
        put(&t, a, i, 60 << 10).unwrap();
    }
    let (image, _) = t.live_image().unwrap();
    let r = DramTier::restore(&cfg(256 * MIB), Announcer::new(None), &image).unwrap();
    for i in 1000..1000 + churn {
        put(&t, a, i, 60 << 10).unwrap();
    }
    (t, r, a)
}

/// 3 000 slots change during the build; then the rounds `p` takes while the donor keeps
/// serving (4 puts and a delete each), then the barrier. Returns the slots the barrier's
/// delta named and the rounds' report; the rebuilt tier is checked against the donor's.
fn barrier_after(p: PreCopy) -> (u64, PreCopyReport) {
    let (t, r, a) = built_while_putting(3000);
    let mut next = 5000;
    let report = p
        .run(|| -> Result<u64, image::ImageError> {
            let (delta, slots) = t.delta_round()?;
            let applied = r.apply_round(&delta)?;
            assert_eq!(applied, slots);
            for _ in 0..4 {
                put(&t, a, next, 60 << 10).unwrap();
                next += 1;
            }
            t.delete(a, &[key(next - 8)]).unwrap();
            Ok(slots)
        })
        .unwrap();
    let barrier = r.apply_delta(&t.delta().unwrap()).unwrap();
    let ka: Vec<u32> = (0..40).chain(1000..4000).chain(5000..next).collect();
    assert_eq!(places(&r, a, &ka), places(&t, a, &ka));
    assert_eq!(r.blocks(), t.blocks());
    assert_eq!(r.snapshot().tier.bytes, t.snapshot().tier.bytes);
    (barrier, report)
}

#[test]
fn pre_copy_rounds_leave_the_barrier_only_what_changed_during_the_last_round() {
    // The barrier's delta is bounded by what one round lets change, not by what changed
    // during the whole build.
    let (barrier, report) = barrier_after(PRE_COPY);
    assert!(
        barrier <= PRE_COPY.small,
        "the barrier moved {barrier} slots (rounds {:?}): more than a round's threshold of {}",
        report.rounds,
        PRE_COPY.small
    );
    assert!(report.rounds.first() >= Some(&3000), "{report:?}");
}

#[test]
fn without_pre_copy_rounds_the_barrier_moves_every_slot_changed_during_the_build() {
    // What the rounds prevent: a barrier delta as large as the build's churn (which grows
    // with the build's length, and so with the block count).
    let (barrier, report) = barrier_after(PreCopy {
        max_rounds: 0,
        ..PRE_COPY
    });
    assert!(report.rounds.is_empty());
    assert!(barrier >= 3000, "{barrier}");
}

#[test]
fn rounds_then_the_barrier_rebuild_the_tier_with_slots_reused_and_namespaces_added() {
    // The changes of `served_through_an_image` (a deleted block's slot reused, a namespace
    // registered, slabs cut) travel in a round; more follow before the barrier.
    let (t, image, a, b) = served_through_an_image();
    let r = DramTier::restore(&cfg(16 * MIB), Announcer::new(None), &image).unwrap();
    let (delta, _) = t.delta_round().unwrap();
    r.apply_round(&delta).unwrap();
    let freed = places(&t, a, &[100])[0].unwrap().0;
    t.delete(a, &[key(100)]).unwrap();
    let reused = put(&t, a, 120, 60 << 10).unwrap();
    assert_eq!(
        reused.offset, freed,
        "the test wants block 100's slot reused"
    );
    t.delete(b, &[key(200)]).unwrap();
    let named = r.apply_delta(&t.delta().unwrap()).unwrap();
    assert!(
        named <= 3,
        "the barrier names the slots changed since the round: {named}"
    );
    let ka: Vec<u32> = (0..40).chain(100..110).chain(120..121).collect();
    assert_eq!(places(&r, a, &ka), places(&t, a, &ka));
    let kb: Vec<u32> = (200..203).collect();
    assert_eq!(places(&r, b, &kb), places(&t, b, &kb));
    assert_eq!(r.blocks(), t.blocks());
    assert_eq!(r.free_and_capacity(), t.free_and_capacity());
    // The barrier leaves the slots it filled on the free lists: they are skipped, so new
    // blocks land in free slots, never on a block's.
    new_blocks_land_in_free_slots(&r, a, &ka, 300..320);
}
