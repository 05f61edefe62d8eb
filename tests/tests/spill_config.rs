//! Spill-directory configuration through real daemons: a second daemon on a directory in use
//! is refused naming the first one's pid, which keeps serving its spilled blocks; the same
//! directory given twice is refused before anything is written. The failed-preallocation,
//! foreign-file and resized-file cases are in `spill/tests/exclusive.rs`.
//! Run: `cargo test --release -p kvnode-e2e --test spill_config`.

use std::time::Duration;

use kvnode_e2e::{Daemon, block, key, spec, spill_dir, tier};

const BLOCK: usize = 256 << 10;
/// Three times what the 16 MiB DRAM tier of `start_spilling` holds.
const BLOCKS: u64 = 192;

fn spilling_args(dir: &str) -> Vec<&str> {
    vec![
        "--dram",
        "16MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--spill-dir",
        dir,
        "--spill-size",
        "96MiB",
    ]
}

#[test]
fn a_second_daemon_on_a_spill_dir_in_use_is_refused_and_the_first_keeps_its_blocks() {
    let dir = spill_dir("spill-config-two");
    let first = Daemon::start_spilling(&dir, "96MiB", &[]);
    let mut c = first.client();
    let ns = c.register(&spec("m", BLOCK as u64)).unwrap().ns;
    kvnode_e2e::fill_and_settle(&mut c, ns, BLOCKS, BLOCK);
    let spilled = tier(&mut c, "nvme").blocks;
    assert!(spilled >= BLOCKS - 64, "only {spilled} blocks on NVMe");

    let (status, log) = Daemon::start_failing(
        &spilling_args(dir.to_str().unwrap()),
        Duration::from_secs(30),
    );
    assert!(!status.success(), "{log}");
    let pid = first.child.id();
    assert!(
        log.contains(&format!("is locked by another process (pid {pid})")),
        "{log}"
    );
    // The refused start changed nothing: the spilled blocks (the first `BLOCKS - 64`, which
    // cannot still be in DRAM) read back from the first daemon's file.
    // (The demoter may still be moving a few more blocks down: never fewer.)
    let now = tier(&mut c, "nvme").blocks;
    assert!(
        now >= spilled,
        "{now} blocks on NVMe after the refused start, {spilled} before"
    );
    for i in 0..BLOCKS - 64 {
        let got = c.get(ns, &[key(i)]).unwrap();
        assert_eq!(
            got[0].as_deref(),
            Some(block(i, BLOCK).as_slice()),
            "block {i}"
        );
    }
    assert_eq!(tier(&mut c, "nvme").corrupt, 0);
    drop(c);
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_same_spill_dir_twice_is_refused_before_anything_is_written() {
    let dir = spill_dir("spill-config-dup");
    let d = dir.to_str().unwrap();
    let twice = |spelled: &str| {
        let mut args = spilling_args(d);
        args.extend_from_slice(&["--spill-dir", spelled, "--spill-size", "96MiB"]);
        Daemon::start_failing(&args, Duration::from_secs(30))
    };
    // A fresh directory: no file may appear.
    let (status, log) = twice(d);
    assert!(!status.success(), "{log}");
    assert!(log.contains("is given twice (entries 0 and 1)"), "{log}");
    assert!(!dir.join("kvnode-spill.dat").exists());
    // An existing spill file, the directory spelled a second way: the file is untouched.
    drop(Daemon::start_spilling(&dir, "96MiB", &[]));
    let before = std::fs::read(dir.join("kvnode-spill.dat")).unwrap();
    let other = format!("{d}/../{}", dir.file_name().unwrap().to_str().unwrap());
    let (status, log) = twice(&other);
    assert!(!status.success(), "{log}");
    assert!(log.contains("is the same directory"), "{log}");
    assert!(std::fs::read(dir.join("kvnode-spill.dat")).unwrap() == before);
    let _ = std::fs::remove_dir_all(&dir);
}
