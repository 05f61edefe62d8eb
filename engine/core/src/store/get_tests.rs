//! Gets in prefix order over a real NVMe tier (spill file under /var/tmp): a DRAM tier of
//! 8 MiB (1 MiB windows, 4 MiB hold limit), 48 pages of 256 KiB (12 MiB) put through
//! `make_room` + `reserve` as the put path does, so the head lives on NVMe only.
//! Run: `cargo test --release -p kvnode-engine --lib store::get_tests`.

use std::sync::Arc;

use kvnode_proto::{Digest, Key, NamespaceSpec};

use super::{Location, Store};
use crate::arena::Arena;
use crate::dram::{DramTier, TierConfig};
use crate::nvme::NvmeTier;
use crate::nvme::config::{SpillDirSetting, SpillSettings};
use crate::obs::Metrics;
use crate::policy::PolicyKind;
use crate::residency::Announcer;

const PAGE: u64 = 256 << 10;
const PAGES: u64 = 48;

fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0x5a;
    Key::page(Digest(d))
}

fn page(i: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|j| (i as u8) ^ (j as u8).rotate_left(3))
        .collect()
}

struct Fixture {
    store: Arc<Store>,
    ns: u32,
    dir: std::path::PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn filled(tag: &str) -> Fixture {
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
    // Let demotions in flight end.
    assert!(
        store
            .nvme()
            .unwrap()
            .wait_idle(std::time::Duration::from_secs(20))
            .await
    );
    Fixture { store, ns, dir }
}

fn keys() -> Vec<Key> {
    (0..PAGES).map(key).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_stream_every_page_of_a_get_larger_than_dram_in_order() {
    let f = filled("stream").await;
    let plan = f.store.plan(f.ns, &keys()).unwrap();
    assert_eq!(plan[0].0, Location::Nvme, "the head was demoted: {plan:?}");
    assert!(plan.iter().all(|p| p.0.is_local() && p.1 == PAGE));
    let windows = f.store.windows(&plan);
    assert!(
        windows.len() >= 12,
        "1 MiB windows over 12 MiB: {windows:?}"
    );
    let mut next = 0;
    for w in windows {
        assert_eq!(w.start, next, "windows are consecutive");
        next = w.end;
        let got = f
            .store
            .lease_window(f.ns, &keys()[w.clone()])
            .await
            .unwrap();
        for (i, l) in w.zip(got) {
            let l = l.unwrap_or_else(|| panic!("page {i} not leased"));
            assert_eq!(l.bytes(), page(i as u64).as_slice(), "page {i}");
        }
    }
    assert_eq!(next, PAGES as usize);
    let t = f.store.snapshot().0.tier;
    assert_eq!((t.leases, t.reserved), (0, 0), "{t:?}");
}

/// What lease-mode gets and GPU onloads get: a prefix, or the point where it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_get_larger_than_the_hold_limit_stops_short_at_a_prefix() {
    let f = filled("hold").await;
    let limit = f.store.hold_limit();
    let got = f.store.lease_prefix(f.ns, &keys(), limit).await.unwrap();
    let short = got
        .short
        .expect("12 MiB of NVMe pages cannot be held under a 4 MiB limit");
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
    let part = f
        .store
        .lease_prefix(f.ns, &keys()[..short], limit)
        .await
        .unwrap();
    assert_eq!(part.short, None);
    assert!(part.leases.iter().all(Option::is_some));
    drop(part);
    let t = f.store.snapshot().0.tier;
    assert_eq!((t.leases, t.reserved), (0, 0), "{t:?}");
}
