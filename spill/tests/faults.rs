//! Pins failure handling: poisoning after a failed write or fsync (writes refused, verified
//! reads continue), FIFO eviction reporting evicted keys, injected read faults as misses,
//! and queue backpressure. Run: `cargo test --release -p kvnode-spill --test faults`.

mod common;

use common::{TempDir, assert_block, data, faulty, key, read_vec, small, write_vec};
use kvnode_spill::{
    FaultPlan, IoBuf, IoEngineKind, MissReason, ReadOutcome, SpillConfig, SpillError, SpillKey,
    SpillTier,
};

/// Blocks 0 and 1 of `len` bytes are written, block 2's write operation number `fail` (from
/// 0) fails: block 2's write returns the I/O error and its buffer, the tier refuses writes
/// from then on, and blocks 0 and 1 still read back.
fn failed_write_poisons_writes_but_reads_continue(len: usize, fail: u64) {
    let d = TempDir::disk();
    let plan = FaultPlan {
        fail_write: Some(fail),
        ..FaultPlan::default()
    };
    let t = SpillTier::open(small(&d.0, 8 << 20, faulty(plan)).build().unwrap()).unwrap();
    write_vec(&t, 0, len);
    write_vec(&t, 1, len);
    let done = t.write(key(2), IoBuf::Vec(data(2, len))).wait();
    assert!(
        matches!(done.result, Err(SpillError::Io { .. })),
        "{:?}",
        done.result
    );
    let IoBuf::Vec(v) = done.buf else { panic!() };
    assert!(
        v == data(2, len),
        "the buffer is handed back with the error"
    );
    let done = t.write(key(3), IoBuf::Vec(data(3, len))).wait();
    let err = done.result.unwrap_err();
    assert!(matches!(err, SpillError::Poisoned { .. }), "{err}");
    assert!(err.to_string().contains("refuses writes"), "{err}");
    assert_block(&t, 0, len);
    assert_block(&t, 1, len);
    assert_eq!(read_vec(&t, 2).0, ReadOutcome::Miss(MissReason::NotFound));
    let s = t.stats();
    assert!(s.poisoned.is_some());
    assert_eq!(s.errors, 1);
}

#[test]
fn a_small_blocks_single_write_failing_poisons_writes_but_reads_continue() {
    // A small block (up to 64 KiB) goes down in one write, header and payload: writes 0 and 1
    // are blocks 0 and 1, write 2 is block 2's.
    failed_write_poisons_writes_but_reads_continue(8192, 2);
}

#[test]
fn a_large_blocks_payload_write_failing_poisons_writes_but_reads_continue() {
    // A larger block's header and payload are two writes: 0..4 are blocks 0 and 1, write 5
    // is block 2's payload (its header write succeeded).
    failed_write_poisons_writes_but_reads_continue(128 << 10, 5);
}

#[test]
fn failed_fsync_poisons_the_tier() {
    let d = TempDir::disk();
    let plan = FaultPlan {
        fail_fsync: Some(0),
        ..FaultPlan::default()
    };
    let t = SpillTier::open(small(&d.0, 8 << 20, faulty(plan)).build().unwrap()).unwrap();
    write_vec(&t, 0, 4096);
    let err = t.sync().wait().unwrap_err();
    assert!(matches!(err, SpillError::Io { .. }), "{err}");
    assert!(t.poisoned().is_some());
    let done = t.write(key(1), IoBuf::Vec(data(1, 4096))).wait();
    assert!(matches!(done.result, Err(SpillError::Poisoned { .. })));
    assert_block(&t, 0, 4096);
}

#[test]
fn sync_succeeds_and_is_counted() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    write_vec(&t, 0, 4096);
    t.sync().wait().unwrap();
    assert!(t.stats().syncs >= 1);
}

/// Writes 200 blocks of 64 KiB into 4 regions of 1 MiB (14 blocks fit in one) and checks
/// that the keys evicted are reported once each, counted, and exactly the oldest ones.
fn evicts_the_oldest_first(engine: IoEngineKind) {
    let d = TempDir::disk();
    let config = small(&d.0, 4096 + (4 << 20), engine)
        .sync_interval(None)
        .build()
        .unwrap();
    let t = SpillTier::open(config).unwrap();
    let mut evicted = Vec::new();
    for i in 0..200 {
        evicted.extend(write_vec(&t, i, 64 << 10).evicted);
    }
    assert!(!evicted.is_empty());
    let s = t.stats();
    assert_eq!(s.evictions, evicted.len() as u64);
    assert_eq!(s.blocks + evicted.len() as u64, 200);
    // FIFO: evicted keys are exactly the oldest ones, each once, in the order written.
    let oldest: Vec<_> = (0..evicted.len() as u64).map(key).collect();
    assert!(
        evicted == oldest,
        "evicted out of order: {:?}",
        numbers(&evicted)
    );
    for i in evicted.len() as u64..200 {
        assert_block(&t, i, 64 << 10);
    }
    assert_eq!(read_vec(&t, 0).0, ReadOutcome::Miss(MissReason::NotFound));
}

/// The block numbers of `keys` (see [`key`]).
fn numbers(keys: &[SpillKey]) -> Vec<u64> {
    keys.iter()
        .map(|k| u64::from_le_bytes(k.digest[..8].try_into().unwrap()))
        .collect()
}

#[test]
fn eviction_when_full_reports_evicted_keys_oldest_first() {
    evicts_the_oldest_first(IoEngineKind::Uring);
}

/// Two regions' seals may finish in either order (their fsyncs race in the kernel: a CI run
/// on a loaded machine saw it). Region 0's seal is made to finish after region 1's; the
/// oldest region must still be the first reclaimed.
#[test]
fn eviction_stays_oldest_first_when_an_older_regions_seal_finishes_last() {
    evicts_the_oldest_first(faulty(FaultPlan {
        late_fsync: Some(0),
        ..FaultPlan::default()
    }));
}

#[test]
fn injected_read_failures_and_short_reads_are_misses() {
    let d = TempDir::disk();
    let plan = FaultPlan {
        fail_read: Some(0),
        ..FaultPlan::default()
    };
    let t = SpillTier::open(small(&d.0, 8 << 20, faulty(plan)).build().unwrap()).unwrap();
    write_vec(&t, 0, 8192);
    assert_eq!(read_vec(&t, 0).0, ReadOutcome::Miss(MissReason::Io));
    assert_block(&t, 0, 8192);
    assert!(t.poisoned().is_none(), "read errors do not poison");
    drop(t);
    let plan = FaultPlan {
        short_reads: true,
        ..FaultPlan::default()
    };
    let t = SpillTier::open(small(&d.0, 8 << 20, faulty(plan)).build().unwrap()).unwrap();
    assert_eq!(read_vec(&t, 0).0, ReadOutcome::Miss(MissReason::Corrupt));
    assert_eq!(t.stats().checksum_failures, 1);
}

#[test]
fn full_submission_queue_refuses_try_write_and_hands_the_buffer_back() {
    let d = TempDir::disk();
    let cfg = SpillConfig::builder()
        .dir(&d.0, 64 << 20)
        .region_size(8 << 20)
        .max_block_size(1 << 20)
        .queue_depth(1)
        .submit_queue(1)
        .build()
        .unwrap();
    let t = SpillTier::open(cfg).unwrap();
    // Buffers first, so submissions come in a tight loop faster than 1 MiB writes complete.
    let bufs: Vec<Vec<u8>> = (0..64).map(|i| data(i, 1 << 20)).collect();
    let pending: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(i, b)| t.try_write(key(i as u64), IoBuf::Vec(b)))
        .collect();
    let mut refused = 0;
    for p in pending {
        let done = p.wait();
        if let Err(SpillError::QueueFull { .. }) = done.result {
            let IoBuf::Vec(v) = done.buf else { panic!() };
            assert_eq!(v.len(), 1 << 20);
            refused += 1;
        }
    }
    assert!(refused > 0, "64 x 1 MiB into a queue of one must overflow");
    assert_eq!(t.stats().queue_full, refused);
    assert_eq!(t.stats().queue_depth, 0);
}
