//! Unit tests of the DRAM tier's metadata: leases, eviction, namespaces, slab reclaim.

use super::test_fixtures::*;
use super::*;

fn tier(capacity: u64, slab: u64, policy: PolicyKind) -> DramTier {
    DramTier::new(&TierConfig {
        capacity,
        slab_bytes: slab,
        policy,
    })
}

fn put(t: &DramTier, ns: u32, i: u32, len: u64) -> Result<Reserved, PutStatus> {
    let r = t.reserve(1, ns, &[key(i)], &[len]).unwrap().remove(0)?;
    assert_eq!(commit(t, 1, &[r]), vec![CommitStatus::Committed]);
    Ok(r)
}

fn commit(t: &DramTier, owner: u64, rs: &[Reserved]) -> Vec<CommitStatus> {
    rs.iter()
        .map(|r| t.commit_one(owner, r, None, false, None))
        .collect()
}

#[test]
fn leased_block_survives_filling_the_tier() {
    for policy in [PolicyKind::Lru, PolicyKind::S3fifo, PolicyKind::Chain] {
        let t = tier(8 * MIB, 2 * MIB, policy);
        let ns = t.register(&spec("m", MIB)).unwrap().ns;
        put(&t, ns, 0, MIB).unwrap();
        let held = t.lease(ns, &[key(0)]).unwrap()[0].unwrap();
        for i in 1..100 {
            put(&t, ns, i, MIB).unwrap();
        }
        let snap = t.snapshot();
        assert!(snap.tier.evictions >= 90, "{:?}", snap.tier);
        assert_eq!(
            t.exists(ns, &[key(0)]).unwrap(),
            1,
            "leased block was evicted"
        );
        let again = t.lease(ns, &[key(0)]).unwrap()[0].unwrap();
        assert_eq!(again.extent, held.extent);
        t.release(&[held.slot, again.slot]);
        assert_eq!(t.snapshot().tier.leases, 0);
    }
}

#[test]
fn everything_leased_means_no_space_not_reuse() {
    let t = tier(4 * MIB, 2 * MIB, PolicyKind::Lru);
    let ns = t.register(&spec("m", MIB)).unwrap().ns;
    for i in 0..4 {
        put(&t, ns, i, MIB).unwrap();
    }
    let keys: Vec<Key> = (0..4).map(key).collect();
    let leases = t.lease(ns, &keys).unwrap();
    assert!(leases.iter().all(Option::is_some));
    assert_eq!(put(&t, ns, 9, MIB), Err(PutStatus::NoSpace));
    let slots: Vec<_> = leases.iter().map(|l| l.unwrap().slot).collect();
    t.release(&slots);
    assert!(put(&t, ns, 9, MIB).is_ok());
}

#[test]
fn namespaces_with_same_digests_are_disjoint() {
    let t = tier(16 * MIB, 2 * MIB, PolicyKind::Lru);
    let a = t.register(&spec("a", 4096)).unwrap().ns;
    let b = t.register(&spec("b", 4096)).unwrap().ns;
    put(&t, a, 1, 10).unwrap();
    assert_eq!(t.exists(b, &[key(1)]).unwrap(), 0);
    assert!(t.lease(b, &[key(1)]).unwrap()[0].is_none());
    put(&t, b, 1, 20).unwrap();
    let la = t.lease(a, &[key(1)]).unwrap()[0].unwrap();
    let lb = t.lease(b, &[key(1)]).unwrap()[0].unwrap();
    assert_ne!(la.extent.offset, lb.extent.offset);
    assert_eq!((la.extent.len, lb.extent.len), (10, 20));
    t.release(&[la.slot, lb.slot]);
    assert_eq!(t.clear(Some(a)).unwrap(), 1);
    assert_eq!(t.exists(b, &[key(1)]).unwrap(), 1);
}

#[test]
fn blocks_are_immutable_and_duplicate_commit_is_refused() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Lru);
    let ns = t.register(&spec("m", 4096)).unwrap().ns;
    let r1 = t
        .reserve(1, ns, &[key(5)], &[100])
        .unwrap()
        .remove(0)
        .unwrap();
    let r2 = t
        .reserve(2, ns, &[key(5)], &[100])
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(commit(&t, 2, &[r2]), vec![CommitStatus::Committed]);
    assert_eq!(commit(&t, 1, &[r1]), vec![CommitStatus::Duplicate]);
    assert_eq!(
        t.reserve(3, ns, &[key(5)], &[1]).unwrap()[0],
        Err(PutStatus::Exists)
    );
    // A connection cannot commit another's reservation, nor commit twice.
    let r3 = t
        .reserve(1, ns, &[key(6)], &[1])
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(commit(&t, 2, &[r3]), vec![CommitStatus::UnknownHandle]);
    assert_eq!(commit(&t, 1, &[r3]), vec![CommitStatus::Committed]);
    assert_eq!(commit(&t, 1, &[r3]), vec![CommitStatus::UnknownHandle]);
}

#[test]
fn delete_while_leased_hides_now_and_frees_on_release() {
    let t = tier(2 * MIB, 2 * MIB, PolicyKind::Lru);
    let ns = t.register(&spec("m", MIB)).unwrap().ns;
    put(&t, ns, 1, MIB).unwrap();
    let l = t.lease(ns, &[key(1)]).unwrap()[0].unwrap();
    assert_eq!(t.delete(ns, &[key(1), key(2)]).unwrap(), 1);
    assert_eq!(t.exists(ns, &[key(1)]).unwrap(), 0);
    // The slot is still held: with two 1 MiB slots, one is free, the doomed one is not.
    put(&t, ns, 2, MIB).unwrap();
    assert_eq!(
        put(&t, ns, 3, MIB).map(|_| ()),
        Ok(()),
        "evicting key 2 is allowed"
    );
    assert_eq!(t.snapshot().pools[0].used, 2);
    t.release(&[l.slot]);
    assert_eq!(t.snapshot().pools[0].free, 1);
}

#[test]
fn oversize_bad_segment_and_unknown_namespace_are_refused() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Lru);
    let ns = t.register(&spec("m", 4096)).unwrap().ns;
    assert_eq!(
        t.reserve(1, ns, &[key(1)], &[4097]).unwrap()[0],
        Err(PutStatus::TooLarge)
    );
    assert_eq!(
        t.reserve(1, ns, &[Key(key(1).0, 3)], &[1]).unwrap()[0],
        Err(PutStatus::BadSegment)
    );
    assert_eq!(
        t.reserve(1, 7, &[key(1)], &[1]),
        Err(TierError::UnknownNamespace(7))
    );
    assert!(matches!(
        t.register(&spec("big", 3 * MIB)),
        Err(TierError::SlotTooLarge { .. })
    ));
    assert_eq!(
        t.reserve(1, ns, &[key(1)], &[]),
        Err(TierError::LengthMismatch { keys: 1, lens: 0 })
    );
}

#[test]
fn new_class_reclaims_a_slab_from_a_full_class() {
    let t = tier(4 * MIB, 2 * MIB, PolicyKind::Lru);
    let a = t.register(&spec("a", MIB)).unwrap().ns;
    let b = t.register(&spec("b", 512 << 10)).unwrap().ns;
    for i in 0..4 {
        put(&t, a, i, MIB).unwrap();
    }
    put(&t, b, 0, 1000).unwrap();
    let s = t.snapshot();
    assert_eq!(
        s.pools.iter().map(|p| p.slabs).collect::<Vec<_>>(),
        vec![1, 1]
    );
    assert_eq!(s.namespaces[0].blocks, 2);
    assert_eq!(s.namespaces[0].evictions, 2);
    assert_eq!(s.tier.blocks, 3);
}

#[test]
fn registration_is_idempotent_and_reports_classes() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Lru);
    let s = NamespaceSpec {
        segments: vec![100, 8192, 5000],
        ..spec("m", 1)
    };
    let r1 = t.register(&s).unwrap();
    let r2 = t.register(&s).unwrap();
    assert_eq!(r1, r2);
    let bytes: Vec<u64> = r1.segments.iter().map(|c| c.class_slot_bytes).collect();
    assert_eq!(bytes, vec![4096, 8192, 8192]);
    assert_eq!(r1.segments[1].class, r1.segments[2].class);
}

#[test]
fn slabs_emptied_by_clear_go_to_another_class_without_eviction() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Lru);
    let a = t.register(&spec("a", MIB)).unwrap().ns;
    let b = t.register(&spec("b", 2 * MIB)).unwrap().ns;
    for i in 0..8 {
        put(&t, a, i, MIB).unwrap();
    }
    assert_eq!(t.clear(Some(a)).unwrap(), 8);
    // All four slabs are empty but still cut into 1 MiB slots: the 2 MiB class takes them.
    for i in 0..4 {
        put(&t, b, i, 2 * MIB).unwrap();
    }
    let s = t.snapshot();
    assert_eq!(s.namespaces[1].blocks, 4, "{:?}", s.pools);
    assert_eq!(s.tier.evictions, 0);
    assert_eq!(
        s.pools.iter().map(|p| p.slabs).collect::<Vec<_>>(),
        vec![0, 4]
    );
}

/// The tier hands the policy each page's place in its put: under `chain` a request's first
/// pages outlive its last ones (LRU, fed the same puts, evicts the first pages first).
#[test]
fn chain_tier_evicts_a_put_from_its_tail() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Chain);
    let ns = t.register(&spec("m", MIB)).unwrap().ns;
    let put_batch = |first: u32, n: u32| {
        let keys: Vec<Key> = (first..first + n).map(key).collect();
        let rs: Vec<Reserved> = t
            .reserve(1, ns, &keys, &vec![MIB; n as usize])
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(
            commit(&t, 1, &rs)
                .iter()
                .all(|s| *s == CommitStatus::Committed)
        );
    };
    put_batch(0, 4);
    put_batch(10, 4);
    // 8 slots: the second put filled the tier; a third evicts four pages.
    put_batch(20, 4);
    let held = |i: u32| t.exists(ns, &[key(i)]).unwrap() == 1;
    let left: Vec<u32> = [0, 1, 2, 3, 10, 11, 12, 13]
        .into_iter()
        .filter(|&i| held(i))
        .collect();
    assert_eq!(left, vec![10, 11, 12, 13], "the oldest put went first");
    // A fourth put evicts the second put from its tail: its head pages stay longest.
    put_batch(30, 2);
    assert!(held(10) && held(11), "a chain's head left before its tail");
    assert!(!held(12) && !held(13), "the chain's tail stayed");
}

#[test]
fn retention_is_held_to_the_tenants_quota_and_to_the_tiers_share() {
    let t = tier(8 * MIB, 2 * MIB, PolicyKind::Lru);
    let a = t.register(&spec("a", MIB)).unwrap().ns;
    let b = t.register(&spec("b", MIB)).unwrap().ns;
    for i in 0..3 {
        put(&t, a, i, MIB).unwrap();
        put(&t, b, 10 + i, MIB).unwrap();
    }
    let ttl = std::time::Duration::from_mins(1);
    let keys = |from: u32| [key(from), key(from + 1), key(from + 2)];
    // Tenant a may hold 2 MiB; the tier 3 MiB for everyone.
    let scope = |set: &'static [u32], limit| RetainScope {
        set: Some(set),
        limit,
        tier_limit: 3 * MIB,
    };
    let ra = t.retain(a, &keys(0), ttl, scope(&[0], 2 * MIB)).unwrap();
    assert_eq!((ra.held, ra.over_quota), (2, 1), "a's own quota");
    // b's quota is ample, but the tier's share leaves room for one block only.
    let rb = t.retain(b, &keys(10), ttl, scope(&[1], 8 * MIB)).unwrap();
    assert_eq!((rb.held, rb.over_quota), (1, 2), "the tier's share");
    let s = t.snapshot().tier;
    assert_eq!(
        (s.retained_blocks, s.retained_bytes, s.retain_refused),
        (3, 3 * MIB, 3)
    );
    // Filling the tier evicts every block but the three held ones.
    for i in 100..120 {
        put(&t, a, i, MIB).unwrap();
    }
    assert_eq!(t.exists(a, &keys(0)[..2]).unwrap(), 2);
    assert_eq!(t.exists(b, &keys(10)[..1]).unwrap(), 1);
    assert_eq!(t.release_retention(a, &keys(0)).unwrap(), 2);
    assert_eq!(t.snapshot().tier.retained_blocks, 1);
}
