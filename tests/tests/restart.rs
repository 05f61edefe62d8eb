//! Restarts that keep the cache (issue 15 §4), against real daemon processes: SIGTERM and a
//! start on the same spill directory (stop-time flush), `--takeover` (the arena memfd and
//! the DRAM index handed to the new process), SIGKILL with `--spill-lag`, and a client
//! connected while the daemon changes hands.
//! Run: `cargo build --release -p kvnode && cargo test --release -p kvnode-e2e --test restart`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::throttle::DiskThrottle;
use kvnode_e2e::{
    Daemon, block, key, not_root, prerequisite, roomy_spilling_args, spec, spill_dir, temp_dir,
    tier,
};
use kvnode_proto::Key;
use kvnode_proto::client::PutStatus;

const LEN: usize = 64 << 10;

fn put_all(c: &mut Client, ns: u32, range: std::ops::Range<u64>) {
    let idx: Vec<u64> = range.collect();
    for chunk in idx.chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, LEN)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let r = c.put(ns, &keys, &refs).expect("put");
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    }
}

/// How many of blocks `range` the daemon returns; panics on any wrong byte.
fn count_intact(c: &mut Client, ns: u32, range: std::ops::Range<u64>) -> u64 {
    let idx: Vec<u64> = range.collect();
    let mut n = 0;
    for chunk in idx.chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        for (g, &i) in c.get(ns, &keys).expect("get").iter().zip(chunk) {
            if let Some(b) = g {
                assert_eq!(b.as_slice(), block(i, LEN).as_slice(), "block {i} changed");
                n += 1;
            }
        }
    }
    n
}

fn stop(d: &mut Daemon, sig: i32) {
    d.signal(sig);
    let st = d
        .wait_exit(Duration::from_mins(1))
        .unwrap_or_else(|| panic!("daemon did not exit; log:\n{}", d.log()));
    if sig == libc::SIGTERM {
        assert!(st.success(), "exit {st:?}; log:\n{}", d.log());
    }
}

#[test]
fn sigterm_then_start_on_the_same_spill_dir_keeps_every_dram_block_byte_identical() {
    let dir = spill_dir("restart-flush");
    let mut a = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..64);
    assert_eq!(
        tier(&mut c, "nvme").blocks,
        0,
        "the test needs DRAM-only blocks"
    );
    drop(c);
    stop(&mut a, libc::SIGTERM);
    assert!(
        a.log()
            .contains("stop-time flush: every DRAM block has a copy on NVMe"),
        "{}",
        a.log()
    );
    let b = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..64), 64, "log:\n{}", b.log());
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_copies_dram_blocks_down_while_still_serving_and_what_is_put_meanwhile_survives() {
    if !prerequisite("root", not_root("a disk write throttle needs a cgroup")) {
        return;
    }
    let dir = spill_dir("restart-precopy");
    let mut a = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    // 32 MiB in DRAM only, written to a disk held to 4 MB/s: the copy down takes ~8 s.
    put_all(&mut c, ns, 0..512);
    let throttle = DiskThrottle::create(a.child.id(), &dir)
        .unwrap_or_else(|e| panic!("cannot throttle the spill disk: {e}"));
    throttle.set_write(Some(4 << 20));
    a.signal(libc::SIGTERM);
    // The daemon still serves: every get hits with its bytes, every put is stored.
    let t = Instant::now();
    let (mut answers, mut put) = (0u64, 1000u64);
    while t.elapsed() < Duration::from_secs(2) {
        let i = answers * 7 % 512;
        let got = c.get(ns, &[key(i)]).unwrap_or_else(|e| {
            panic!(
                "get {answers} after SIGTERM ({:?}): {e}; log:\n{}",
                t.elapsed(),
                a.log()
            )
        });
        assert_eq!(got[0].as_deref(), Some(block(i, LEN).as_slice()));
        // At most 256 puts (16 MiB): with the 512 blocks, 48 MiB of the 64 MiB tier, so no
        // put needs room. Past that DRAM must demote to the disk held to 4 MB/s, and a put
        // that waited `room_wait_ms` for it evicts without a copy, as documented: a loaded
        // machine lost one of the 512 blocks that way (this test failed once with 516 puts).
        if put < 1000 + 256 {
            put_all(&mut c, ns, put..put + 1);
            put += 1;
        }
        answers += 1;
    }
    assert!(answers > 10, "{answers} answers in 2 s");
    drop(c);
    throttle.set_write(None);
    let st = a
        .wait_exit(Duration::from_mins(1))
        .unwrap_or_else(|| panic!("daemon did not exit; log:\n{}", a.log()));
    assert!(st.success(), "exit {st:?}; log:\n{}", a.log());
    drop(throttle);
    // Everything, including what was put after the signal, is on NVMe for the next start.
    let b = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..512), 512, "log:\n{}", a.log());
    assert_eq!(
        count_intact(&mut c, ns, 1000..put),
        put - 1000,
        "log:\n{}",
        a.log()
    );
    drop(c);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until the NVMe tier reports `want` of `what` (a counter of its stats row).
fn wait_nvme(
    c: &mut Client,
    what: &str,
    want: u64,
    counter: fn(&kvnode_proto::stats::TierStats) -> u64,
) {
    let t0 = Instant::now();
    loop {
        let t = tier(c, "nvme");
        if counter(&t) >= want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_mins(1),
            "the NVMe tier never reached {want} {what}: {t:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn blocks_deleted_or_cleared_on_nvme_stay_gone_after_sigkill_and_after_sigterm() {
    let dir = spill_dir("deletes");
    let mut a = Daemon::start_roomy_spilling(&dir, &["--spill-lag", "200ms"]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    let other = c.register(&spec("other", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..32);
    put_all(&mut c, other, 0..16);
    wait_nvme(&mut c, "blocks copied down", 48, |t| t.copied_down);
    // Deleted and cleared while on NVMe (and in DRAM): two keys, one whole namespace.
    assert_eq!(c.delete(ns, &[key(3), key(4)]).unwrap(), 2);
    c.clear(Some(other)).unwrap();
    // Three markers (two deletes, one clear) in the one spill file: written, not a timer.
    wait_nvme(&mut c, "delete markers", 3, |t| t.delete_markers);
    drop(c);
    stop(&mut a, libc::SIGKILL);

    let mut b = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    let other = c.register(&spec("other", LEN as u64)).unwrap().ns;
    let nvme = tier(&mut c, "nvme");
    assert_eq!(
        (nvme.blocks, nvme.recovered_deleted),
        (30, 2 + 16),
        "after SIGKILL: {nvme:?}; log:\n{}",
        b.log()
    );
    assert_eq!(c.get(ns, &[key(3), key(4)]).unwrap(), vec![None, None]);
    assert_eq!(count_intact(&mut c, ns, 0..32), 30);
    assert_eq!(count_intact(&mut c, other, 0..16), 0);
    // Now only on NVMe: a delete, then SIGTERM and a start.
    assert_eq!(c.delete(ns, &[key(10)]).unwrap(), 1);
    drop(c);
    stop(&mut b, libc::SIGTERM);
    let d = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = d.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(
        c.get(ns, &[key(10)]).unwrap(),
        vec![None],
        "log:\n{}",
        d.log()
    );
    assert_eq!(count_intact(&mut c, ns, 0..32), 29);
    drop(c);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// How long the seam holds the successor's spill recovery back.
const RECOVERY_DELAY_MS: u64 = 8_000;

#[test]
fn a_restarted_daemon_serves_while_its_spill_index_is_rebuilt_and_a_delete_made_meanwhile_sticks() {
    let dir = spill_dir("restart-recovering");
    let mut a = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..64);
    drop(c);
    stop(&mut a, libc::SIGTERM);
    // The successor's recovery is held back (a test seam), standing for the seconds a
    // large spill index takes: the daemon must answer long before it ends.
    let sock = temp_dir("recovering-sock").join("kvnode.sock");
    let delay = RECOVERY_DELAY_MS.to_string();
    let args = roomy_spilling_args(&dir);
    let spawned = Instant::now();
    let b = Daemon::spawn_at_env(
        &sock,
        &[("KVNODE_TEST_SPILL_RECOVERY_DELAY_MS", delay.as_str())],
        &args,
    );
    b.wait_answering(Duration::from_millis(RECOVERY_DELAY_MS / 2));
    let mut c = b.client();
    let s = c.stats().unwrap();
    let answered = spawned.elapsed();
    assert!(
        answered < Duration::from_millis(RECOVERY_DELAY_MS / 2)
            && s.spill_recovering
            && s.tiers.len() == 1,
        "answering {answered:?} after the spawn, the spill tier is still being recovered: {:?}",
        s.tiers
    );
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    // Blocks only on NVMe are misses meanwhile (an engine recomputes them); DRAM serves.
    assert_eq!(count_intact(&mut c, ns, 0..64), 0);
    put_all(&mut c, ns, 100..108);
    assert_eq!(count_intact(&mut c, ns, 100..108), 8);
    c.delete(ns, &[key(5), key(6)]).unwrap();
    let t = Instant::now();
    while c.stats().unwrap().spill_recovering {
        assert!(
            t.elapsed() < Duration::from_mins(1),
            "the spill tier never attached; log:\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        spawned.elapsed() >= Duration::from_millis(RECOVERY_DELAY_MS),
        "the seam held the recovery back"
    );
    // Recovered: every flushed block is found again, byte-identical, except the two
    // deleted while the index was rebuilt; the blocks put meanwhile are kept.
    assert_eq!(tier(&mut c, "nvme").blocks, 64 - 2, "log:\n{}", b.log());
    assert_eq!(count_intact(&mut c, ns, 0..64), 62, "log:\n{}", b.log());
    assert_eq!(c.get(ns, &[key(5), key(6)]).unwrap(), vec![None, None]);
    assert_eq!(count_intact(&mut c, ns, 100..108), 8);
    drop(c);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_stop_time_flush_dram_only_blocks_are_lost() {
    // The control for the test above: the flush is what keeps them.
    let dir = spill_dir("restart-noflush");
    let cfg = temp_dir("noflush").join("k.toml");
    std::fs::write(&cfg, "[spill]\nflush_on_stop_s = 0\n").unwrap();
    let cfg = cfg.to_str().unwrap().to_owned();
    let mut a = Daemon::start_roomy_spilling(&dir, &["--config", &cfg]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..16);
    drop(c);
    stop(&mut a, libc::SIGTERM);
    let b = Daemon::start_roomy_spilling(&dir, &["--config", &cfg]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..16), 0);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `blocks=N` field of the first log line containing `msg` (colour codes stripped).
fn logged_blocks(log: &str, msg: &str) -> u64 {
    let line = log
        .lines()
        .find(|l| l.contains(msg))
        .unwrap_or_else(|| panic!("no `{msg}` line in the log:\n{log}"));
    let mut plain = String::new();
    let mut in_escape = false;
    for ch in line.chars() {
        match (in_escape, ch) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (false, _) => plain.push(ch),
            (true, _) => {}
        }
    }
    plain
        .split_whitespace()
        .find_map(|w| w.strip_prefix("blocks="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no blocks=N in `{plain}`"))
}

#[test]
fn takeover_hands_every_block_over_and_the_old_daemon_exits_zero() {
    let dir = spill_dir("takeover");
    let sock_dir = temp_dir("takeover-sock");
    let sock = sock_dir.join("kvnode.sock");
    let args = [
        "--dram",
        "16MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--spill-dir",
        dir.to_str().unwrap(),
        "--spill-size",
        "128MiB",
    ];
    let mut a = Daemon::start_at(&sock, &args);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    // 24 MiB into a 16 MiB tier: some blocks live on NVMe only, the rest in DRAM only.
    put_all(&mut c, ns, 0..384);
    let t0 = Instant::now();
    while tier(&mut c, "dram").in_flight > 0 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let in_dram = tier(&mut c, "dram").blocks;
    assert!(in_dram > 100, "dram holds {in_dram}");
    drop(c);
    let mut with_takeover = args.to_vec();
    with_takeover.push("--takeover");
    let spawned = Instant::now();
    let b = Daemon::spawn_at(&sock, &with_takeover);
    let st = a.wait_exit(Duration::from_secs(30)).unwrap_or_else(|| {
        panic!(
            "old daemon still runs; log:\n{}\nnew:\n{}",
            a.log(),
            b.log()
        )
    });
    assert!(st.success(), "{st:?}\n{}", a.log());
    assert!(a.log().contains("DRAM tier handed over"), "{}", a.log());
    // First hit from the new process.
    let first_hit = loop {
        if let Ok(mut c) = Client::connect(&sock)
            && let Ok(s) = c.stats()
            && s.pid == b.child.id()
        {
            let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
            let last = key(383);
            if c.get(ns, &[last]).ok().and_then(|v| v[0].clone()).is_some() {
                break spawned.elapsed();
            }
        }
        assert!(
            spawned.elapsed() < Duration::from_secs(30),
            "new daemon never answered; log:\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let mut c = Client::connect(&sock).unwrap();
    // Every DRAM block the old daemon held when it handed over came over (its demoter may
    // have moved a few down after `in_dram` was read; the new one may since have too).
    let handed = logged_blocks(&a.log(), "DRAM tier handed over");
    assert!(
        handed > 100 && handed <= in_dram,
        "handed over {handed} of {in_dram}"
    );
    let d = tier(&mut c, "dram");
    assert_eq!(
        d.blocks + d.demotions,
        handed,
        "DRAM blocks after the takeover; log:\n{}",
        b.log()
    );
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    // The blocks on NVMe are found once the successor's spill index is rebuilt.
    b.wait_ready(Duration::from_secs(30));
    assert_eq!(count_intact(&mut c, ns, 0..384), 384, "log:\n{}", b.log());
    eprintln!("takeover: first hit {first_hit:?} after the new process was spawned");
    // Wall-clock bound with headroom for a loaded CI machine; the 1 s figure is measured
    // by `kvnode bench restart` (docs/benchmarks.md).
    assert!(first_hit < Duration::from_secs(5), "{first_hit:?}");
    drop(c);
    drop(b);
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

#[test]
fn takeover_with_another_dram_size_is_refused_clearly_and_loses_nothing() {
    let sock_dir = temp_dir("takeover-refused");
    let sock = sock_dir.join("kvnode.sock");
    let a = Daemon::start_at(&sock, &["--dram", "32MiB", "--no-pin"]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..32);
    let mut b = Daemon::spawn_at(&sock, &["--dram", "64MiB", "--no-pin", "--takeover"]);
    let st = b
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("refused successor still runs; log:\n{}", b.log()));
    assert!(!st.success());
    let log = b.log();
    assert!(
        log.contains("refused the takeover and keeps serving")
            && log.contains("dram 33554432 -> 67108864"),
        "{log}"
    );
    assert_eq!(count_intact(&mut c, ns, 0..32), 32);
    let s = c.stats().unwrap();
    assert_eq!(s.pid, a.child.id());
    drop(c);
    drop(a);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

/// What `--spill-lag` guarantees (it is a target, not a bound: docs/operations.md, "Write-behind"): every
/// block committed to DRAM is copied to NVMe by write-behind, and a block counted as copied
/// survives SIGKILL. The test waits for the copies the daemon reports (`copied_down`), not
/// for a span of time; without write-behind nothing is copied and SIGKILL loses it all.
#[test]
fn sigkill_with_spill_lag_keeps_every_block_write_behind_copied() {
    let dir = spill_dir("lag");
    let mut a = Daemon::start_roomy_spilling(&dir, &["--spill-lag", "200ms"]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..64);
    let t0 = Instant::now();
    wait_nvme(&mut c, "blocks copied down by write-behind", 64, |t| {
        t.copied_down
    });
    let nvme = tier(&mut c, "nvme");
    assert_eq!(nvme.blocks, 64, "{nvme:?}");
    eprintln!(
        "write-behind copied 64 blocks {:?} after the last put (lag 200 ms; lag exceeded {} times)",
        t0.elapsed(),
        nvme.lag_exceeded
    );
    drop(c);
    stop(&mut a, libc::SIGKILL);
    let b = Daemon::start_roomy_spilling(&dir, &[]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..64), 64, "log:\n{}", b.log());
    drop(b);
    // The control: without write-behind nothing is copied (the DRAM tier is roomy, nothing
    // is demoted), and SIGKILL loses the DRAM-only blocks.
    let dir2 = spill_dir("nolag");
    let mut a = Daemon::start_roomy_spilling(&dir2, &[]);
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..16);
    let nvme = tier(&mut c, "nvme");
    assert_eq!((nvme.blocks, nvme.copied_down), (0, 0), "{nvme:?}");
    drop(c);
    stop(&mut a, libc::SIGKILL);
    let b = Daemon::start_roomy_spilling(&dir2, &[]);
    let mut c = b.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..16), 0);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn a_client_reading_through_a_takeover_gets_right_bytes_or_an_error() {
    let sock_dir = temp_dir("takeover-client");
    let sock = sock_dir.join("kvnode.sock");
    let args = ["--dram", "32MiB", "--no-pin"];
    let mut a = Daemon::start_at(&sock, &args);
    let mut c = a.client();
    let ns_spec = spec("m", LEN as u64);
    let ns = c.register(&ns_spec).unwrap().ns;
    put_all(&mut c, ns, 0..64);
    drop(c);
    let done = Arc::new(AtomicBool::new(false));
    let (ok, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let reader = {
        let (done, ok, errors, sock) = (done.clone(), ok.clone(), errors.clone(), sock.clone());
        std::thread::spawn(move || {
            let mut conn: Option<(Client, u32)> = None;
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) {
                if conn.is_none() {
                    conn = Client::connect(&sock).ok().and_then(|mut c| {
                        c.register(&spec("m", LEN as u64)).ok().map(|r| (c, r.ns))
                    });
                }
                let Some((c, ns)) = conn.as_mut() else {
                    errors.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                };
                let Ok(v) = c.get(*ns, &[key(i % 64)]) else {
                    errors.fetch_add(1, Ordering::Relaxed);
                    conn = None;
                    continue;
                };
                // A block the daemon returns is always the right one.
                let b = v[0].as_ref().expect("a block vanished during the takeover");
                assert_eq!(b.as_slice(), block(i % 64, LEN).as_slice(), "wrong bytes");
                ok.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    while ok.load(Ordering::Relaxed) < 100 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut with_takeover = args.to_vec();
    with_takeover.push("--takeover");
    let b = Daemon::spawn_at(&sock, &with_takeover);
    assert!(
        a.wait_exit(Duration::from_secs(30))
            .is_some_and(|s| s.success()),
        "{}",
        a.log()
    );
    let before = ok.load(Ordering::Relaxed);
    let t = Instant::now();
    while ok.load(Ordering::Relaxed) < before + 100 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no reads served after the takeover; log:\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    done.store(true, Ordering::Relaxed);
    reader
        .join()
        .expect("reader saw wrong bytes or a lost block");
    eprintln!(
        "reads: {} served, {} failed across the takeover",
        ok.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed)
    );
    let mut c = Client::connect(&sock).unwrap();
    assert_eq!(c.stats().unwrap().pid, b.child.id());
    drop(c);
    drop(b);
    drop(a);
    let _ = std::fs::remove_dir_all(&sock_dir);
}

/// Reads one datagram from the emulated systemd notification socket.
fn notified(s: &std::os::unix::net::UnixDatagram) -> String {
    let mut b = [0u8; 512];
    let n = s.recv(&mut b).expect("a notification within the timeout");
    String::from_utf8_lossy(&b[..n]).into_owned()
}

#[test]
fn under_systemd_notify_a_takeover_reports_the_new_main_pid() {
    // systemd's side of `Type=notify` + `NotifyAccess=all`, emulated: a datagram socket in
    // NOTIFY_SOCKET. The unit's `systemctl reload` relies on MAINPID= (packaging/kvnode.service).
    let sock_dir = temp_dir("notify");
    let notify_path = sock_dir.join("notify");
    let n = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    n.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let env = [("NOTIFY_SOCKET", notify_path.to_str().unwrap())];
    let mut a = Daemon::start_env(&env, &["--dram", "32MiB", "--no-pin"]);
    assert_eq!(notified(&n), "READY=1");
    let mut c = a.client();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    put_all(&mut c, ns, 0..8);
    drop(c);
    // The successor must run on the same socket as `a`.
    let a_sock = a.socket.clone();
    let mut cmd = kvnode_e2e::kvnode_cmd();
    let log = std::fs::File::create(sock_dir.join("b.log")).unwrap();
    let mut b = cmd
        .args([
            "serve",
            "--dram",
            "32MiB",
            "--no-pin",
            "--takeover",
            "--socket",
        ])
        .arg(&a_sock)
        .envs(env)
        .stderr(log)
        .spawn()
        .unwrap();
    // MAINPID first, before the old daemon is released (it then exits 0 as a non-main
    // process), READY once the new one serves.
    assert_eq!(notified(&n), format!("MAINPID={}", b.id()));
    assert_eq!(notified(&n), "READY=1");
    assert!(
        a.wait_exit(Duration::from_secs(30))
            .is_some_and(|s| s.success())
    );
    let mut c = Client::connect(&a_sock).unwrap();
    let ns = c.register(&spec("m", LEN as u64)).unwrap().ns;
    assert_eq!(count_intact(&mut c, ns, 0..8), 8);
    drop(c);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(libc::pid_t::try_from(b.id()).unwrap(), libc::SIGTERM) };
    assert_eq!(notified(&n), "STOPPING=1");
    assert!(b.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&sock_dir);
}
