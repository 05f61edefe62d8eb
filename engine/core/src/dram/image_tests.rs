//! Unit tests of the DRAM image (takeover) and of copies down (flush, write-behind).

use super::test_fixtures::*;
use super::*;

fn put(t: &DramTier, ns: u32, i: u32, len: u64) -> Reserved {
    let r = t
        .reserve(1, ns, &[key(i)], &[len])
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(
        t.commit_one(1, &r, None, false, Some(u64::from(i))),
        CommitStatus::Committed
    );
    r
}

#[test]
fn a_restored_tier_finds_every_block_at_its_old_offset_and_allocates_around_them() {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    let b = t.register(&spec("b", 300 << 10)).unwrap().ns;
    let mut held = Vec::new();
    for i in 0..40 {
        held.push((a, i, put(&t, a, i, 60 << 10)));
    }
    for i in 100..110 {
        held.push((b, i, put(&t, b, i, 300 << 10)));
    }
    t.delete(a, &[key(3)]).unwrap();
    let image = t.image().unwrap();
    let r = DramTier::restore(&cfg(16 * MIB), Announcer::new(None), &image).unwrap();
    assert_eq!(r.snapshot().tier.blocks, 49);
    assert_eq!(r.snapshot().tier.bytes, t.snapshot().tier.bytes);
    for (ns, i, res) in &held {
        let got = r.lease(*ns, &[key(*i)]).unwrap()[0];
        if *i == 3 {
            assert!(got.is_none(), "a deleted block came back");
            continue;
        }
        let got = got.unwrap();
        assert_eq!(got.extent.offset, res.offset, "block {i} moved");
        assert_eq!(got.extent.len, res.len);
        assert_eq!(got.fingerprint, Some(u64::from(*i)));
        r.release(&[got.slot]);
    }
    // New blocks land in free slots, never on a restored one.
    let taken: std::collections::HashSet<u64> = held.iter().map(|h| h.2.offset).collect();
    for i in 200..230 {
        let n = put(&r, a, i, 60 << 10);
        assert!(
            !taken.contains(&n.offset) || n.offset == held[3].2.offset,
            "slot of a restored block handed out again"
        );
    }
}

#[test]
fn an_image_is_refused_whole_by_another_layout_or_when_damaged() {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    put(&t, a, 1, 1000);
    let image = t.image().unwrap();
    let e = DramTier::restore(&cfg(32 * MIB), Announcer::new(None), &image).unwrap_err();
    assert!(e.to_string().contains("must not change"), "{e}");
    let e = DramTier::restore(
        &cfg(16 * MIB),
        Announcer::new(None),
        &image[..image.len() - 3],
    )
    .unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    let mut bad = image.clone();
    bad[0] = b'X';
    assert!(DramTier::restore(&cfg(16 * MIB), Announcer::new(None), &bad).is_err());
}

#[test]
fn an_image_is_refused_while_a_slot_is_reserved() {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    let r = t
        .reserve(7, a, &[key(1)], &[100])
        .unwrap()
        .remove(0)
        .unwrap();
    assert!(t.image().unwrap_err().to_string().contains("reserved"));
    t.abort(7, &[r]);
    assert!(t.image().is_ok());
}

#[test]
fn copies_down_mark_blocks_once_and_write_behind_picks_in_commit_order() {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    t.set_has_lower(true);
    t.set_write_behind(true);
    for i in 0..5 {
        put(&t, a, i, 4096);
    }
    let now = std::time::Instant::now();
    let picked = t.pick_write_behind(3, now);
    let order: Vec<Key> = picked.iter().map(|c| Key(c.key.digest, 0)).collect();
    assert_eq!(order, vec![key(0), key(1), key(2)]);
    // Picked blocks are not picked again by the flush while their copy runs.
    let rest = t.pick_uncopied(10, &|_| false);
    assert_eq!(rest.len(), 2);
    assert_eq!(t.count_uncopied(&|_| true), 0);
    for c in picked.iter().chain(&rest) {
        assert!(!t.finish_copy(c, true, |_| {}));
    }
    // Copied blocks (with their copy present below) need no second copy.
    assert!(t.pick_uncopied(10, &|_| true).is_empty());
    // A copy whose block was deleted meanwhile reports it, and frees the slot.
    put(&t, a, 9, 4096);
    let c = t.pick_write_behind(10, std::time::Instant::now());
    assert_eq!(c.len(), 1);
    t.delete(a, &[key(9)]).unwrap();
    assert!(t.finish_copy(&c[0], true, |_| {}));
    assert_eq!(t.snapshot().tier.leases, 0);
}

#[test]
fn a_walk_in_bounded_stretches_picks_every_uncopied_block_once_and_queues_what_is_committed_meanwhile()
 {
    let t = DramTier::new(&cfg(16 * MIB));
    let a = t.register(&spec("a", 64 << 10)).unwrap().ns;
    t.set_has_lower(true);
    for i in 0..40 {
        put(&t, a, i, 4096);
    }
    // The stop-time copy while serving: commits from now on are queued; the 40 blocks
    // already here are found by the walk, 7 slots at a time, each once.
    t.track_commits();
    let (mut picked, mut from, mut walks) = (Vec::new(), Some(0), 0);
    while let Some(at) = from {
        let (batch, next) = t.pick_uncopied_from(at, 4, 7, &|_| false);
        assert!(batch.len() <= 4);
        picked.extend(batch);
        from = next;
        walks += 1;
        if walks == 3 {
            put(&t, a, 100, 4096);
        }
    }
    let mut walked: Vec<u32> = picked
        .iter()
        .map(|c| u32::from_be_bytes(c.key.digest.0[..4].try_into().unwrap()))
        .collect();
    walked.sort_unstable();
    walked.dedup();
    assert_eq!(picked.len(), walked.len(), "no block picked twice");
    // The walk may or may not meet block 100 (committed into a slot it had passed or not);
    // the queue has it either way, and a pick skips it while its copy runs.
    assert!(picked.len() == 40 || picked.len() == 41, "{}", picked.len());
    assert_eq!(t.queued_copies(), 1);
    let late = t.pick_write_behind(10, std::time::Instant::now());
    assert_eq!(late.len(), 41 - picked.len());
    // A copy that fails is queued again; one that succeeds is done.
    let (failed, rest) = picked.split_first().unwrap();
    assert!(!t.finish_copy(failed, false, |_| {}));
    for c in rest.iter().chain(&late) {
        assert!(!t.finish_copy(c, true, |_| {}));
    }
    assert_eq!(t.queued_copies(), 1);
    let again = t.pick_write_behind(10, std::time::Instant::now());
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].key, failed.key);
    assert!(!t.finish_copy(&again[0], true, |_| {}));
    assert_eq!(t.snapshot().tier.leases, 0);
}
