//! Gets in prefix order over a real NVMe tier (spill file under /var/tmp): a DRAM tier of
//! 8 MiB (1 MiB windows, 4 MiB hold limit), 48 pages of 256 KiB (12 MiB) put through
//! `make_room` + `reserve` as the put path does, so the head lives on NVMe only.
//! Run: `cargo test --release -p kvnode-engine --lib store::get_tests`.

use std::sync::Arc;

use kvnode_proto::{Digest, Key, NamespaceSpec};

use super::{Delivery, Got, Location, Store};
use crate::arena::Arena;
use crate::dram::{DramTier, TierConfig};
use crate::nvme::NvmeTier;
use crate::nvme::config::{SpillDirSetting, SpillSettings};
use crate::obs::Metrics;
use crate::policy::PolicyKind;
use crate::residency::Announcer;

const PAGE: u64 = 256 << 10;
const PAGES: u64 = 48;
/// Pages at the head of the fill that the fixture puts on NVMe only.
const HEAD: u64 = 24;

pub(super) fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0x5a;
    Key::page(Digest(d))
}

pub(super) fn page(i: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|j| (i as u8) ^ (j as u8).rotate_left(3))
        .collect()
}

pub(super) struct Fixture {
    pub store: Arc<Store>,
    pub ns: u32,
    dir: std::path::PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) async fn filled(tag: &str) -> Fixture {
    let dir = std::env::temp_dir().join(format!("kvnode-get-tests-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
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
    let settings = SpillSettings {
        dirs: vec![SpillDirSetting {
            path: dir.clone(),
            size: 64 << 20,
        }],
        ..SpillSettings::default()
    };
    let nvme = NvmeTier::open(
        &settings,
        1 << 20,
        &arena,
        Arc::clone(&announcer),
        Arc::new(Metrics::default()),
    )
    .expect("spill tier");
    let store = Store::new(arena, dram, Some(Arc::new(nvme)), announcer);
    let ns = store
        .register(&NamespaceSpec {
            model: "get-tests".into(),
            page_size: 16,
            segments: vec![PAGE],
            ..NamespaceSpec::default()
        })
        .unwrap()
        .ns;
    for i in 0..PAGES {
        store.make_room(PAGE).await;
        let mut r = store.reserve(1, ns, &[key(i)], &[PAGE]).unwrap();
        let mut r = r.pop().unwrap().expect("a slot once room is made");
        r.bytes_mut().copy_from_slice(&page(i));
        r.commit();
    }
    // The head on NVMe only, whatever the demoter did meanwhile: the first 24 pages (6 MiB,
    // past the 4 MiB hold limit) are moved down now. Left to the demoter, how many pages it
    // had moved by the end of the fill depended on scheduling; on a loaded machine it was
    // sometimes only 16 (4 MiB), so a holding get was not cut by the limit.
    let head: Vec<Key> = (0..HEAD).map(key).collect();
    store.demote_now(ns, &head).await.expect("the head demoted");
    // Let demotions in flight end.
    assert!(
        store
            .nvme()
            .unwrap()
            .wait_idle(std::time::Duration::from_secs(20))
            .await
    );
    let plan = store.locate(ns, &keys()).unwrap();
    assert!(
        plan[..HEAD as usize].iter().all(|l| *l == Location::Nvme),
        "the head is on NVMe only: {plan:?}"
    );
    Fixture { store, ns, dir }
}

fn keys() -> Vec<Key> {
    (0..PAGES).map(key).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_stream_every_page_of_a_get_larger_than_dram_in_order() {
    let f = filled("stream").await;
    let before = f.store.snapshot().0.tier;
    let mut p = f.store.prefix(f.ns, &keys(), Delivery::Stream).unwrap();
    assert_eq!(p.plan()[0].0, Location::Nvme, "the head was demoted");
    assert!(p.plan().iter().all(|p| p.0.is_local() && p.1 == PAGE));
    let on_nvme = p.plan().iter().filter(|p| p.0 == Location::Nvme).count() as u64;
    let (mut next, mut windows) = (0, 0);
    while let Some(w) = p.next().await.unwrap() {
        assert_eq!(w.start, next, "windows are consecutive");
        next = w.range().end;
        windows += 1;
        // This window and the one promoted ahead: DRAM use stays bounded.
        let held = f.store.snapshot().0.tier.leases;
        assert!(
            held <= 2 * 4,
            "{held} pages leased at once (1 MiB windows of 4 pages)"
        );
        for (i, g) in w.range().zip(w.got) {
            let Got::Leased(l) = g else {
                panic!("page {i} not leased: {g:?}")
            };
            assert_eq!(l.bytes(), page(i as u64).as_slice(), "page {i}");
        }
    }
    assert!(windows >= 12, "1 MiB windows over 12 MiB: {windows}");
    assert_eq!(next, PAGES as usize);
    let t = f.store.snapshot().0.tier;
    assert_eq!((t.leases, t.reserved), (0, 0), "{t:?}");
    // Each promoted page counts one DRAM miss and one hit (commit_leased leases it without
    // a lookup after the commit); pages planned in DRAM and evicted by the promotions of
    // earlier windows are promoted too.
    let promoted = t.promotions - before.promotions;
    assert!(promoted >= on_nvme, "{t:?}");
    assert_eq!(t.misses - before.misses, promoted, "{t:?}");
    assert_eq!(t.hits - before.hits, PAGES, "{t:?}");
}

/// What lease-mode gets and GPU onloads get: a prefix, or the point where it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_get_larger_than_the_hold_limit_stops_short_at_a_prefix() {
    let f = filled("hold").await;
    let got = f.store.hold(f.ns, &keys(), false).await.unwrap();
    let short = got
        .short
        .expect("12 MiB of NVMe pages cannot be held under a 4 MiB limit");
    assert!(
        got.over_limit,
        "cut by the limit, not by room: short at {short}, {:?}",
        f.store.snapshot().0.tier
    );
    assert!(short > 0 && short < PAGES as usize, "short at {short}");
    for (i, l) in got.leases.iter().enumerate() {
        if i < short {
            let l = l
                .as_ref()
                .unwrap_or_else(|| panic!("page {i} of the prefix"));
            assert_eq!(l.bytes(), page(i as u64).as_slice(), "page {i}");
        } else {
            assert!(l.is_none(), "page {i} past the stop is not leased");
        }
    }
    drop(got);
    // The leading part it named is leasable whole.
    let part = f.store.hold(f.ns, &keys()[..short], false).await.unwrap();
    assert_eq!(part.short, None);
    assert!(part.leases.iter().all(Option::is_some));
    drop(part);
    let t = f.store.snapshot().0.tier;
    assert_eq!((t.leases, t.reserved), (0, 0), "{t:?}");
}

/// DRAM full of leased blocks: a get of pages on NVMe ends at its first page with
/// `NoRoom`, and nothing after it is leased (no hole in front of later pages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_no_room_ends_its_prefix_there() {
    let f = filled("noroom").await;
    let plan: Vec<Location> = f.store.locate(f.ns, &keys()).unwrap();
    let in_dram: Vec<Key> = keys()
        .into_iter()
        .zip(&plan)
        .filter(|(_, l)| **l == Location::Dram)
        .map(|(k, _)| k)
        .collect();
    let on_nvme: Vec<Key> = keys()
        .into_iter()
        .zip(&plan)
        .filter(|(_, l)| **l == Location::Nvme)
        .map(|(k, _)| k)
        .collect();
    // Every resident block leased, and every free slot reserved: no room at all.
    let held = f.store.hold(f.ns, &in_dram, false).await.unwrap();
    assert_eq!(held.short, None);
    let mut fillers = Vec::new();
    for i in 0.. {
        let k = key(1000 + i);
        match f
            .store
            .reserve(1, f.ns, &[k], &[PAGE])
            .unwrap()
            .pop()
            .unwrap()
        {
            Ok(r) => fillers.push(r),
            Err(_) => break,
        }
    }
    let mut p = f
        .store
        .prefix(
            f.ns,
            &on_nvme[..4],
            Delivery::Hold {
                limit: u64::MAX,
                wait: false,
            },
        )
        .unwrap();
    let w = p.next().await.unwrap().expect("one window");
    assert!(matches!(w.got[0], Got::NoRoom), "{:?}", w.got[0]);
    assert!(
        w.got.iter().all(|g| matches!(g, Got::NoRoom)),
        "{:?}",
        w.got
    );
    assert_eq!(w.end(), Some(0));
    assert!(p.next().await.unwrap().is_none(), "the prefix ended");
    drop((w, fillers, held));
    // With room again the same keys are leased.
    let again = f.store.hold(f.ns, &on_nvme[..4], false).await.unwrap();
    assert_eq!(again.short, None);
    assert!(again.leases.iter().all(Option::is_some));
}
