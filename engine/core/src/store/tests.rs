//! Store unit tests: guards release what they hold on every path, and the lookup order.
//! Run: `cargo test --release -p kvnode-engine store::tests`.

use std::sync::Arc;

use kvnode_proto::client::{CommitStatus, PutStatus};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use super::{Location, Store};
use crate::arena::Arena;
use crate::dram::{DramTier, TierConfig};
use crate::policy::PolicyKind;
use crate::residency::Announcer;

const PAGE: u64 = 64 << 10;

fn store() -> (Arc<Store>, u32) {
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
    let s = Store::new(arena, dram, None, announcer);
    let ns = s
        .register(&NamespaceSpec {
            model: "store-tests".into(),
            page_size: 64,
            segments: vec![PAGE],
            ..NamespaceSpec::default()
        })
        .unwrap()
        .ns;
    (s, ns)
}

fn key(i: u8) -> Key {
    let mut d = [0u8; 32];
    d[0] = i;
    Key::page(Digest(d))
}

fn counts(s: &Store) -> (u64, u64) {
    let t = s.snapshot().0.tier;
    (t.leases, t.reserved)
}

/// A handler that fails after reserving: the `?` returns early, dropping the reservation.
fn reserve_then_fail(s: &Arc<Store>, ns: u32) -> Result<(), &'static str> {
    let mut r = s.reserve(7, ns, &[key(1)], &[PAGE]).unwrap();
    let slot = r.pop().unwrap().map_err(|_| "no slot")?;
    assert_eq!(counts(s).1, 1, "the slot is reserved while the guard lives");
    let _held = slot;
    Err("client went away mid-write")?;
    Ok(())
}

#[test]
fn an_early_returning_error_path_releases_its_reservation() {
    let (s, ns) = store();
    assert!(reserve_then_fail(&s, ns).is_err());
    assert_eq!(counts(&s), (0, 0), "the dropped guard aborted the slot");
    // The same key can be stored afterwards: nothing is pinned.
    let mut r = s
        .reserve(8, ns, &[key(1)], &[PAGE])
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    r.bytes_mut().fill(3);
    assert_eq!(r.commit(), CommitStatus::Committed);
    assert_eq!(s.exists(ns, &[key(1)]).unwrap(), 1);
}

#[tokio::test]
async fn a_lease_is_released_when_it_drops_and_pins_its_block_until_then() {
    let (s, ns) = store();
    let mut r = s
        .reserve(1, ns, &[key(2)], &[PAGE])
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    r.bytes_mut().fill(9);
    r.commit();
    let leased = s.lease(ns, &[key(2), key(3)]).await.unwrap();
    assert!(leased[1].is_none());
    let b = leased[0].as_ref().unwrap();
    assert!(b.bytes().iter().all(|&x| x == 9));
    assert_eq!(counts(&s).0, 1);
    // Deleting a leased block leaves its bytes readable until the lease drops.
    assert_eq!(s.delete(ns, &[key(2)]).unwrap(), 1);
    assert!(b.bytes().iter().all(|&x| x == 9));
    drop(leased);
    assert_eq!(counts(&s), (0, 0));
    assert_eq!(s.locate(ns, &[key(2)]).unwrap(), vec![Location::Absent]);
}

#[test]
fn a_second_reservation_of_a_committed_key_is_refused_as_exists() {
    let (s, ns) = store();
    let r = s
        .reserve(1, ns, &[key(4)], &[PAGE])
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    r.commit();
    let again = s.reserve(1, ns, &[key(4)], &[PAGE]).unwrap().pop().unwrap();
    assert_eq!(again.err(), Some(PutStatus::Exists));
    assert_eq!(counts(&s), (0, 0));
}
