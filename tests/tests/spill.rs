//! The NVMe spill tier through real daemons and real files under /var/tmp: demotion past DRAM,
//! restart survival (SIGKILL and SIGTERM), damaged files, and poisoning through the fault
//! engine. Run: `cargo test --release -p kvnode-e2e --test spill`.

use std::path::Path;
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_client::kvnode_proto::client::PutStatus;
use kvnode_e2e::{Daemon, block, key, spec, spill_dir, tier};
use kvnode_proto::Key;

const BLOCK: usize = 256 << 10;
/// 16 MiB of DRAM holds 64 such blocks; 200 is three times that.
const BLOCKS: u64 = 200;
/// Blocks that cannot all fit in DRAM at the end: the first `BLOCKS - 64` were demoted.
const SURELY_SPILLED: u64 = BLOCKS - 64;

fn start(dir: &Path, extra: &[&str]) -> Daemon {
    Daemon::start_spilling(dir, "96MiB", extra)
}

/// Waits until no demotion is in flight.
fn settle(c: &mut Client) {
    let t0 = Instant::now();
    while tier(c, "dram").in_flight > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "demotions never finished"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn put_all(c: &mut Client, ns: u32) {
    for chunk in (0..BLOCKS).collect::<Vec<_>>().chunks(4) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, BLOCK)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let r = c.put(ns, &keys, &refs).unwrap();
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    }
    settle(c);
}

fn restart_serves_spilled_blocks(signal: i32) {
    let dir = spill_dir(&format!("spill-restart{signal}"));
    let mut d = start(&dir, &[]);
    let mut c = d.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    put_all(&mut c, ns);
    let dram = tier(&mut c, "dram");
    assert_eq!(dram.dropped, 0, "every evicted block was demoted: {dram:?}");
    assert!(dram.demotions >= SURELY_SPILLED, "{dram:?}");
    assert!(tier(&mut c, "nvme").blocks >= SURELY_SPILLED);
    drop(c);
    d.signal(signal);
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "daemon did not exit"
    );

    let d2 = start(&dir, &[]);
    let mut c = d2.client();
    assert!(
        tier(&mut c, "nvme").blocks >= SURELY_SPILLED,
        "index rebuilt at start-up"
    );
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    let keys: Vec<Key> = (0..SURELY_SPILLED).map(key).collect();
    assert_eq!(u64::from(c.exists(ns, &keys).unwrap()), SURELY_SPILLED);
    for chunk in keys.chunks(8) {
        let got = c.get(ns, chunk).unwrap();
        for (k, g) in chunk.iter().zip(got) {
            let i = u64::from_be_bytes(k.0.0[..8].try_into().unwrap());
            assert_eq!(g.as_deref(), Some(block(i, BLOCK).as_slice()), "block {i}");
        }
    }
    let nvme = tier(&mut c, "nvme");
    assert_eq!(nvme.promotions, SURELY_SPILLED, "{nvme:?}");
    drop(d2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blocks_spilled_before_sigkill_are_served_byte_identical_after_restart() {
    restart_serves_spilled_blocks(libc::SIGKILL);
}

#[test]
fn blocks_spilled_before_sigterm_are_served_byte_identical_after_restart() {
    restart_serves_spilled_blocks(libc::SIGTERM);
}

fn damaged_file_gives_misses_never_wrong_bytes(tag: &str, damage: impl Fn(&Path)) {
    let dir = spill_dir(tag);
    let mut d = start(&dir, &[]);
    let mut c = d.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    put_all(&mut c, ns);
    drop(c);
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit(Duration::from_secs(10)).is_some());
    damage(&dir.join("kvnode-spill.dat"));

    let d2 = start(&dir, &[]);
    let mut c = d2.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    let (mut hits, mut misses) = (0, 0);
    for i in 0..SURELY_SPILLED {
        match c.get(ns, &[key(i)]).unwrap().remove(0) {
            Some(b) => {
                assert_eq!(b, block(i, BLOCK), "block {i} served with wrong bytes");
                hits += 1;
            }
            None => misses += 1,
        }
    }
    assert!(misses > 0, "the damage hit no block");
    assert!(hits > 0, "undamaged blocks must still be served");
    // The daemon is still up and serving.
    c.put(ns, &[key(10_000)], &[&block(10_000, 100)]).unwrap();
    drop(d2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flipped_bytes_in_the_spill_file_become_misses() {
    damaged_file_gives_misses_never_wrong_bytes("flip", |f| {
        let mut bytes = std::fs::read(f).unwrap();
        // Flip one byte every 64 KiB over the first 16 MiB of regions.
        for off in (4096..16 << 20).step_by(64 << 10) {
            bytes[off + 100] ^= 0xff;
        }
        std::fs::write(f, bytes).unwrap();
    });
}

#[test]
fn truncated_spill_file_becomes_misses() {
    damaged_file_gives_misses_never_wrong_bytes("truncate", |f| {
        let len = std::fs::metadata(f).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        file.set_len(len / 4).unwrap();
    });
}

#[test]
fn poisoned_spill_tier_is_reported_and_dram_keeps_serving() {
    let dir = spill_dir("poison");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        format!(
            "[spill]\ndirs = [{{ path = {:?}, size = \"96MiB\" }}]\ndebug_fault = {{ fail_write = 3 }}\n",
            dir.join("files")
        ),
    )
    .unwrap();
    let d = Daemon::start(&[
        "--dram",
        "16MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    let mut c = d.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    put_all(&mut c, ns);
    let nvme = tier(&mut c, "nvme");
    assert!(nvme.poisoned.is_some(), "{nvme:?}");
    assert!(nvme.errors > 0, "{nvme:?}");
    let dram = tier(&mut c, "dram");
    assert!(
        dram.dropped > 0,
        "after poisoning, evictions drop: {dram:?}"
    );
    // DRAM still serves the newest blocks byte-exact.
    let last = key(BLOCKS - 1);
    let got = c.get(ns, &[last]).unwrap().remove(0);
    assert_eq!(got.as_deref(), Some(block(BLOCKS - 1, BLOCK).as_slice()));
    let text = kvnode_e2e::stats_text(d.socket());
    assert!(text.contains("POISONED"), "{text}");
    let log = d.log();
    assert!(log.contains("poisoned"), "{log}");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
