//! Fetch plans on real slow paths (issue 41, docs/fetch-plans.md): a disk throttled by a
//! cgroup (blkio / io.max) flips the plan to recompute and back to fetch once it is fast
//! again. Needs root (cgroups); without it the test fails unless
//! `KVNODE_TEST_ALLOW_SKIP=root` says skipping is intended.
//! Run: `sudo cargo test --release -p kvnode-e2e --test fetch_plans`.

use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::throttle::DiskThrottle;
use kvnode_e2e::{Daemon, block, fill_and_settle, key, not_root, prerequisite, spec, spill_dir};
use kvnode_proto::Key;
use kvnode_proto::plan::{FetchPlan, PlanReason, PlanSource, ReadPath, RecomputeCost};

const MIB: usize = 1 << 20;

/// An engine that recomputes a 1 MiB page (16 tokens) in 10 ms: a recompute-equivalent rate
/// of ~100 MB/s, between this VM's disk (~1.7 GB/s O_DIRECT) and the throttled one (8 MB/s).
fn engine() -> RecomputeCost {
    RecomputeCost {
        page_tokens: 16,
        keys_per_page: 1,
        tokens_per_s: 1600.0,
        quad_s: 0.0,
        start_tokens: 0,
        via: ReadPath::Copy,
    }
}

/// Keys `from..to` that are on NVMe only now (the plan's own view).
fn nvme_keys(c: &mut Client, ns: u32, from: u64, to: u64) -> Vec<Key> {
    (from..to)
        .filter(|&i| {
            let p = c.exists_plan(ns, &[key(i)], None, &engine()).expect("plan");
            p.plan.runs.first().map(|r| r.source) == Some(PlanSource::Nvme)
        })
        .map(key)
        .collect()
}

/// The plan for `keys`; then fetches what it planned (checking every byte) and returns it.
fn plan_and_fetch(c: &mut Client, ns: u32, keys: &[Key]) -> FetchPlan {
    let p = c.exists_plan(ns, keys, None, &engine()).expect("plan").plan;
    let n = p.keys as usize;
    let got = c.get(ns, &keys[..n]).expect("get the planned keys");
    for (k, g) in keys[..n].iter().zip(got) {
        let i = u64::from_be_bytes(k.0.0[..8].try_into().expect("8 bytes"));
        assert_eq!(g.as_deref(), Some(block(i, MIB).as_slice()), "block {i}");
    }
    p
}

#[test]
fn a_throttled_disk_flips_the_plan_to_recompute_and_an_unthrottled_one_back_to_fetch() {
    if !prerequisite("root", not_root("a disk throttle needs a cgroup")) {
        return;
    }
    let dir = spill_dir("plans-disk");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(&cfg, "[plans]\nreprobe_s = 1.0\nprobe_ms = 20.0\n").expect("config");
    let d = Daemon::start_spilling(&dir, "512MiB", &["--config", cfg.to_str().expect("utf8")]);
    let mut c = d.client();
    let throttle = DiskThrottle::create(c.daemon_pid(), &dir)
        .unwrap_or_else(|e| panic!("cannot throttle the spill disk: {e}"));
    let ns = c.register(&spec("plans", MIB as u64)).expect("register").ns;
    fill_and_settle(&mut c, ns, 300, MIB);
    let mut on_nvme = nvme_keys(&mut c, ns, 0, 280).into_iter();
    let mut next = |n: usize| -> Vec<Key> { on_nvme.by_ref().take(n).collect() };

    // Never measured: a bounded probe (4 MiB), not the whole run.
    let keys = next(24);
    assert_eq!(keys.len(), 24, "blocks on NVMe to plan over");
    let p = plan_and_fetch(&mut c, ns, &keys);
    assert_eq!(
        (p.reason, p.cut_by),
        (PlanReason::Probe, Some(PlanSource::Nvme)),
        "{}",
        p.note
    );
    assert_eq!(p.keys, 4, "{}", p.note);
    // Measured fast: fetched whole.
    let p = plan_and_fetch(&mut c, ns, &next(24));
    assert_eq!((p.reason, p.keys), (PlanReason::All, 24), "{}", p.note);
    let fast = cost(&mut c, "nvme_read");
    assert!(
        fast > 200e6,
        "the unthrottled disk reads faster than recompute: {fast} B/s"
    );

    // Throttled to 8 MB/s (a page then takes ~130 ms to read, 10 ms to recompute). The
    // figure is fresh, so the next plan still fetches; what it moves measures the slow disk.
    throttle.set(Some(8_000_000));
    let p = plan_and_fetch(&mut c, ns, &next(2));
    assert_eq!(p.keys, 2, "{}", p.note);
    let p = plan_and_fetch(&mut c, ns, &next(24));
    assert_eq!((p.reason, p.keys), (PlanReason::Slower, 0), "{}", p.note);
    assert_eq!(p.cut_by, Some(PlanSource::Nvme));
    let slow = cost(&mut c, "nvme_read");
    assert!(
        slow < 100e6 && slow < fast / 10.0,
        "the model shows the throttled disk: {slow} B/s (before {fast})"
    );

    // Unthrottled: once the figure is older than reprobe_s, small probes see the fast disk
    // again and the plan goes back to fetching everything.
    throttle.set(None);
    let t0 = Instant::now();
    let mut probes = 0;
    loop {
        std::thread::sleep(Duration::from_millis(1100));
        let p = plan_and_fetch(&mut c, ns, &next(8));
        if p.reason == PlanReason::All {
            assert_eq!(p.keys, 8);
            break;
        }
        assert!(
            p.keys <= 1,
            "a stale slow path is probed with one page: {}",
            p.note
        );
        probes += u32::from(p.reason == PlanReason::Probe);
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never went back to fetching"
        );
    }
    assert!(probes >= 1, "recovery came through probes");
    let s = c.stats().expect("stats").plans;
    assert!(s.probe >= 2 && s.slower >= 1 && s.all >= 2, "{s:?}");
    assert!(s.keys_recompute >= 24, "{s:?}");
}

/// The live cost model's rate for `path`.
fn cost(c: &mut Client, path: &str) -> f64 {
    let s = c.stats().expect("stats");
    s.costs
        .iter()
        .find(|p| p.path == path)
        .unwrap_or_else(|| panic!("no {path} figure in {:?}", s.costs))
        .bytes_per_s
}
