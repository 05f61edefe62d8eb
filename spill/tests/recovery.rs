//! Pins restart behaviour: clean reopen, crash without shutdown, a torn block write at every
//! cut point (fault engine crash mode), and damaged files (flipped bytes, truncation,
//! deletion). Complete blocks read back byte-identical; damaged ones are counted misses.
//! Run: `cargo test --release -p kvnode-spill --test recovery`.

mod common;

use common::{TempDir, assert_block, data, read_vec, small, write_vec};
use kvnode_spill::{FaultPlan, IoEngineKind, MissReason, ReadOutcome, SpillError, SpillTier};
use std::os::unix::fs::FileExt;

fn len_of(i: u64) -> usize {
    1 + (i as usize * 7919) % (200 << 10)
}

fn open(d: &TempDir, engine: IoEngineKind, seal: bool) -> SpillTier {
    SpillTier::open(
        small(&d.0, 16 << 20, engine)
            .seal_on_shutdown(seal)
            .build()
            .unwrap(),
    )
    .unwrap()
}

fn reopen_serves_every_block(engine: IoEngineKind, seal: bool) {
    let d = TempDir::disk();
    let t = open(&d, engine.clone(), seal);
    for i in 0..40 {
        write_vec(&t, i, len_of(i));
    }
    drop(t);
    let t = open(&d, engine, true);
    let r = t.recovery();
    assert_eq!(r.blocks, 40, "{r:?}");
    assert_eq!(r.skipped, 0);
    if seal {
        assert_eq!(r.files[0].scanned, 0, "clean shutdown seals every region");
    } else {
        assert!(
            r.files[0].scanned >= 1,
            "the open region must be scanned after a crash"
        );
    }
    for i in 0..40 {
        assert_block(&t, i, len_of(i));
    }
    // Writes after recovery get higher sequence numbers and coexist with recovered blocks.
    write_vec(&t, 1000, 5000);
    drop(t);
    let t = open(&d, IoEngineKind::Uring, true);
    assert_eq!(t.recovery().blocks, 41);
    assert_block(&t, 1000, 5000);
    assert_block(&t, 7, len_of(7));
}

#[test]
fn clean_reopen_serves_every_block_from_summaries() {
    reopen_serves_every_block(IoEngineKind::Uring, true);
}

#[test]
fn reopen_after_crash_without_shutdown_serves_every_completed_block() {
    reopen_serves_every_block(IoEngineKind::Uring, false);
}

#[test]
fn psync_reopen_after_crash_serves_every_completed_block() {
    let d = TempDir::shm();
    let t = open(&d, IoEngineKind::Psync, false);
    for i in 0..20 {
        write_vec(&t, i, len_of(i));
    }
    drop(t);
    let t = open(&d, IoEngineKind::Psync, true);
    assert_eq!(t.recovery().blocks, 20);
    for i in 0..20 {
        assert_block(&t, i, len_of(i));
    }
}

/// Writes blocks 0..3 fully, then crashes after `cut` more bytes of block 3's write.
fn crash_at(d: &TempDir, base: u64, cut: u64) -> (bool, u64) {
    let plan = FaultPlan {
        crash_after_bytes: Some(base + cut),
        ..FaultPlan::default()
    };
    let engine = IoEngineKind::Faulty {
        inner: Box::new(IoEngineKind::Psync),
        plan,
    };
    let t = open(d, engine, false);
    for i in 0..4 {
        write_vec(&t, i, 10_000);
    }
    drop(t);
    let t = open(d, IoEngineKind::Psync, true);
    for i in 0..3 {
        assert_block(&t, i, 10_000);
    }
    let (out, v) = read_vec(&t, 3);
    let served = match out {
        ReadOutcome::Hit { len } => {
            assert!(
                len == 10_000 && v == data(3, 10_000),
                "torn block served wrong bytes at cut {cut}"
            );
            true
        }
        ReadOutcome::Miss(MissReason::NotFound) => false,
        other => panic!("unexpected outcome {other:?} at cut {cut}"),
    };
    (served, t.recovery().skipped)
}

#[test]
fn torn_write_at_every_cut_point_is_never_served() {
    // One block write = header sector (4096) + payload (10 000 bytes) zero-padded to the
    // sector (12 288): a small block goes down in one write. Cut anywhere before the payload's
    // last byte, the block is not served; from there on (only padding missing) it is, with
    // its bytes (crash_at checks them).
    let payload_end = 4096 + 10_000;
    let extent = 4096 + 12_288;
    let base = 3 * extent;
    let d = TempDir::shm();
    let mut served_at = Vec::new();
    let mut skipped_total = 0;
    let cuts: Vec<u64> = (0..=extent)
        .step_by(97)
        .chain([
            4095,
            4096,
            4097,
            payload_end - 1,
            payload_end,
            extent - 1,
            extent,
        ])
        .collect();
    for &cut in &cuts {
        let _ = std::fs::remove_file(d.file());
        let (served, skipped) = crash_at(&d, base, cut);
        skipped_total += skipped;
        if served {
            served_at.push(cut);
        }
    }
    let complete: Vec<u64> = cuts.iter().copied().filter(|&c| c >= payload_end).collect();
    assert_eq!(
        served_at, complete,
        "only a write whose payload landed whole may be served"
    );
    assert!(skipped_total > 0, "torn blocks must be counted as skipped");
}

#[test]
fn torn_direct_write_at_sector_cuts_is_never_served() {
    let d = TempDir::disk();
    for keep in [0u64, 4096, 8192, 12_288, 16_384] {
        let _ = std::fs::remove_file(d.file());
        // Write 0 is block 0 (header and payload in one write: a small block), write 1 is
        // block 1's 20 480 bytes: tear it at `keep` (at 4096 the header landed whole, the
        // payload not at all).
        let plan = FaultPlan {
            torn_write: Some((1, keep)),
            ..FaultPlan::default()
        };
        let engine = IoEngineKind::Faulty {
            inner: Box::new(IoEngineKind::Uring),
            plan,
        };
        let t = open(&d, engine, false);
        write_vec(&t, 0, 16_384);
        write_vec(&t, 1, 16_384);
        drop(t);
        let t = open(&d, IoEngineKind::Uring, true);
        assert_block(&t, 0, 16_384);
        assert_eq!(
            read_vec(&t, 1).0,
            ReadOutcome::Miss(MissReason::NotFound),
            "keep {keep}"
        );
        // A header that landed with a torn payload is counted; nothing landed: nothing to count.
        assert_eq!(t.recovery().skipped, u64::from(keep >= 4096), "keep {keep}");
    }
}

#[test]
fn flipped_payload_bytes_become_counted_misses_never_wrong_data() {
    let d = TempDir::disk();
    let t = open(&d, IoEngineKind::Uring, true);
    for i in 0..10 {
        write_vec(&t, i, 20_000);
    }
    drop(t);
    // Block 4's payload starts one sector after its header; blocks are 4096 + 20480 apart.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.file())
        .unwrap();
    let payload4 = 4096 + 4 * (4096 + 20_480) + 4096;
    f.write_all_at(&[0xFF; 8], payload4 + 1000).unwrap();
    drop(f);
    let t = open(&d, IoEngineKind::Uring, true);
    assert_eq!(read_vec(&t, 4).0, ReadOutcome::Miss(MissReason::Corrupt));
    assert_eq!(t.stats().checksum_failures, 1);
    assert_eq!(
        read_vec(&t, 4).0,
        ReadOutcome::Miss(MissReason::NotFound),
        "dropped after failing"
    );
    for i in (0..10).filter(|&i| i != 4) {
        assert_block(&t, i, 20_000);
    }
}

#[test]
fn damage_while_running_is_a_miss_and_truncation_at_rest_loses_only_the_cut_blocks() {
    let d = TempDir::disk();
    let t = open(&d, IoEngineKind::Uring, true);
    for i in 0..60 {
        write_vec(&t, i, 60_000);
    }
    // Cut the file after the first region while the tier is running.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.file())
        .unwrap();
    f.set_len(4096 + (1 << 20)).unwrap();
    let (mut hits, mut misses) = (0, 0);
    for i in 0..60 {
        match read_vec(&t, i) {
            (ReadOutcome::Hit { len }, v) => {
                assert!(len == 60_000 && v == data(i, 60_000));
                hits += 1;
            }
            (ReadOutcome::Miss(MissReason::Corrupt), _) => misses += 1,
            other => panic!("unexpected {:?}", other.0),
        }
    }
    assert!(hits > 0 && misses > 0, "hits {hits} misses {misses}");
    drop(t);
    let t = open(&d, IoEngineKind::Uring, true);
    assert_eq!(t.recovery().blocks, hits);
    for i in 0..60 {
        if let (ReadOutcome::Hit { .. }, v) = read_vec(&t, i) {
            assert!(v == data(i, 60_000));
        }
    }
}

#[test]
fn deleted_file_starts_empty_and_foreign_or_resized_files_are_refused() {
    let d = TempDir::disk();
    let t = open(&d, IoEngineKind::Uring, true);
    write_vec(&t, 1, 5000);
    drop(t);
    std::fs::remove_file(d.file()).unwrap();
    let t = open(&d, IoEngineKind::Uring, true);
    assert_eq!(t.recovery().blocks, 0);
    assert!(t.recovery().files[0].fresh);
    assert_eq!(read_vec(&t, 1).0, ReadOutcome::Miss(MissReason::NotFound));
    drop(t);
    let cfg = small(&d.0, 32 << 20, IoEngineKind::Uring).build().unwrap();
    assert!(matches!(
        SpillTier::open(cfg),
        Err(SpillError::GeometryMismatch { .. })
    ));
    std::fs::write(d.file(), b"somebody else's file").unwrap();
    let err =
        SpillTier::open(small(&d.0, 16 << 20, IoEngineKind::Uring).build().unwrap()).unwrap_err();
    assert!(matches!(err, SpillError::NotASpillFile { .. }), "{err}");
}

#[test]
fn damaged_superblock_reinitialises_the_file() {
    let d = TempDir::disk();
    let t = open(&d, IoEngineKind::Uring, true);
    write_vec(&t, 1, 5000);
    drop(t);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.file())
        .unwrap();
    f.write_all_at(&[0x55], 20).unwrap();
    drop(f);
    let t = open(&d, IoEngineKind::Uring, true);
    assert!(t.recovery().files[0].fresh);
    assert_eq!(read_vec(&t, 1).0, ReadOutcome::Miss(MissReason::NotFound));
}
