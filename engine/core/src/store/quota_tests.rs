//! DRAM quotas at the store: a tenant at its quota evicts its own least-recently-used
//! blocks (never another tenant's), a key is refused `NoSpace` only when nothing of the
//! tenant's can go, and slots held reserved count against the quota. Run: `cargo test --release -p kvnode-engine store::quota_tests`.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use kvnode_proto::client::PutStatus;
use kvnode_proto::{Digest, Key, NamespaceSpec};

use super::Store;
use crate::arena::Arena;
use crate::dram::{DramTier, TierConfig};
use crate::policy::PolicyKind;
use crate::residency::Announcer;
use crate::tenant::{TenantSettings, Tenants, TenantsConfig, Unmapped};

const PAGE: u64 = 64 << 10;

/// A store with tenants `a` (quota: 3 pages) and `b` (none), one namespace each.
fn store() -> (Arc<Store>, u32, u32) {
    let arena = Arc::new(Arena::create(8 << 20, false).expect("arena"));
    let announcer = Announcer::new(None);
    let dram = Arc::new(DramTier::with_announcer(
        &TierConfig {
            capacity: arena.len(),
            slab_bytes: 1 << 20,
            policy: PolicyKind::Lru,
        },
        Arc::clone(&announcer),
    ));
    let tenants = Arc::new(Tenants::new(&TenantsConfig {
        unmapped: Unmapped::Refuse,
        tenant: vec![
            TenantSettings {
                name: "a".into(),
                uids: vec![1],
                dram_quota: Some(3 * PAGE),
                ..TenantSettings::default()
            },
            TenantSettings {
                name: "b".into(),
                uids: vec![2],
                ..TenantSettings::default()
            },
        ],
        ..TenantsConfig::default()
    }));
    let s = Store::with_tenants(arena, dram, None, announcer, Arc::clone(&tenants));
    let mut handles = [0; 2];
    for (t, h) in handles.iter_mut().enumerate() {
        let spec = tenants.scoped_spec(
            t as u16,
            &NamespaceSpec {
                model: "quota-tests".into(),
                page_size: 64,
                segments: vec![PAGE],
                ..NamespaceSpec::default()
            },
        );
        let r = s.register(&spec).unwrap();
        tenants.bind(r.ns, r.id, t as u16);
        *h = r.ns;
    }
    (s, handles[0], handles[1])
}

fn key(i: u8) -> Key {
    let mut d = [0u8; 32];
    d[0] = i;
    Key::page(Digest(d))
}

fn put(s: &Arc<Store>, ns: u32, i: u8) -> PutStatus {
    match s.reserve(9, ns, &[key(i)], &[PAGE]).unwrap().pop().unwrap() {
        Ok(r) => {
            r.commit();
            PutStatus::Stored
        }
        Err(st) => st,
    }
}

#[tokio::test]
async fn a_tenant_at_its_quota_evicts_its_own_oldest_blocks() {
    let (s, a, b) = store();
    for i in 0..3 {
        assert_eq!(put(&s, b, i), PutStatus::Stored);
        assert_eq!(put(&s, a, i), PutStatus::Stored);
    }
    // Touch A's block 0 so block 1 is A's least recently used.
    drop(s.lease(a, &[key(0)]).await.unwrap());
    assert_eq!(put(&s, a, 3), PutStatus::Stored);
    let held: Vec<bool> = s
        .dram
        .contains(a, &[key(0), key(1), key(2), key(3)])
        .unwrap();
    assert_eq!(held, vec![true, false, true, true]);
    assert_eq!(s.namespace_bytes(&[a]), 3 * PAGE);
    assert_eq!(
        s.exists(b, &[key(0), key(1), key(2)]).unwrap(),
        3,
        "B untouched"
    );
    assert_eq!(s.tenants().get(0).dram_quota_evictions.load(Relaxed), 1);
}

#[tokio::test]
async fn nothing_evictable_means_no_space_and_a_counted_refusal() {
    let (s, a, _) = store();
    for i in 0..3 {
        assert_eq!(put(&s, a, i), PutStatus::Stored);
    }
    let leases = s.lease(a, &[key(0), key(1), key(2)]).await.unwrap();
    assert!(leases.iter().all(Option::is_some));
    assert_eq!(put(&s, a, 3), PutStatus::NoSpace);
    assert_eq!(s.tenants().get(0).quota_refusals.load(Relaxed), 1);
    drop(leases);
    assert_eq!(put(&s, a, 3), PutStatus::Stored);
    assert_eq!(s.namespace_bytes(&[a]), 3 * PAGE);
}

#[test]
fn reservations_in_flight_count_against_the_quota() {
    let (s, a, _) = store();
    // Three slots held reserved (a slow writer): the quota is full though nothing is committed.
    let held: Vec<_> = (0..3)
        .map(|i| {
            s.reserve(9, a, &[key(i)], &[PAGE])
                .unwrap()
                .pop()
                .unwrap()
                .unwrap()
        })
        .collect();
    assert_eq!(put(&s, a, 3), PutStatus::NoSpace);
    // Aborting one gives its bytes back; committing the rest keeps them counted once.
    let mut held = held.into_iter();
    drop(held.next());
    assert_eq!(put(&s, a, 3), PutStatus::Stored);
    for r in held {
        r.commit();
    }
    assert_eq!(s.tenants().get(0).dram_reserved.load(Relaxed), 0);
    assert_eq!(s.namespace_bytes(&[a]), 3 * PAGE);
    assert_eq!(put(&s, a, 4), PutStatus::Stored, "own oldest block evicted");
}
