//! Pins write/read round trips on real files: `io_uring` `O_DIRECT` on /var/tmp (ext4) and the
//! psync engine on /dev/shm (tmpfs), arena fixed buffers, bounce buffers, many sizes.
//! Run: `cargo test --release -p kvnode-spill --test roundtrip`.

mod common;

use common::{Mapping, TempDir, assert_block, data, key, read_vec, small, write_vec};
use kvnode_spill::{
    AlignedBuf, ArenaSlice, IoBuf, IoEngineKind, MissReason, RawBuf, ReadOutcome, SpillConfig,
    SpillError, SpillTier,
};

fn sizes() -> Vec<usize> {
    vec![
        0,
        1,
        100,
        4095,
        4096,
        4097,
        8192,
        65_536,
        100_000,
        256 << 10,
    ]
}

fn round_trip_many_sizes(t: &SpillTier) {
    for (i, &len) in sizes().iter().enumerate() {
        write_vec(t, i as u64, len);
    }
    for (i, &len) in sizes().iter().enumerate() {
        assert_block(t, i as u64, len);
    }
    let s = t.stats();
    assert_eq!(s.blocks, sizes().len() as u64);
    assert_eq!(s.hits, sizes().len() as u64);
    assert_eq!(s.misses, 0);
}

#[test]
fn uring_round_trips_variable_sizes_byte_for_byte() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    round_trip_many_sizes(&t);
    assert!(
        t.stats().bounce_copies > 0,
        "unaligned Vec buffers must bounce under O_DIRECT"
    );
}

#[test]
fn psync_round_trips_on_tmpfs_without_bouncing() {
    let d = TempDir::shm();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Psync).build().unwrap()).unwrap();
    round_trip_many_sizes(&t);
    assert_eq!(t.stats().bounce_copies, 0);
}

/// tmpfs refused `O_DIRECT` before Linux 6.6 and accepts it since; either way the tier must
/// either work or fail at open with an error that names the psync fallback.
#[test]
fn uring_on_tmpfs_works_or_is_refused_with_a_clear_error() {
    let d = TempDir::shm();
    match SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()) {
        Ok(t) => round_trip_many_sizes(&t),
        Err(err @ SpillError::DirectIoUnsupported { .. }) => {
            assert!(err.to_string().contains("psync"), "{err}");
        }
        Err(err) => panic!("unexpected error: {err}"),
    }
}

#[test]
fn arena_blocks_round_trip_through_fixed_buffers_without_bouncing() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 16 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    let mut arena = Mapping::new(8 << 20);
    // SAFETY: the mapping outlives the tier (dropped after it, below) and each slice is
    // only touched by this test while no operation on it is in flight.
    unsafe { t.register_arena(arena.ptr, arena.len).unwrap() };
    let bs = 256 << 10;
    for i in 0..16u64 {
        arena
            .slice(i as usize * bs, bs)
            .copy_from_slice(&data(i, bs));
    }
    let writes: Vec<_> = (0..16u64)
        .map(|i| {
            t.write(
                key(i),
                IoBuf::Arena(ArenaSlice {
                    offset: i as usize * bs,
                    len: bs,
                }),
            )
        })
        .collect();
    for w in writes {
        w.wait().result.unwrap();
    }
    let reads: Vec<_> = (0..16u64)
        .map(|i| {
            t.read(
                key(i),
                IoBuf::Arena(ArenaSlice {
                    offset: (16 + i as usize) * bs,
                    len: bs,
                }),
            )
        })
        .collect();
    for r in reads {
        assert_eq!(r.wait().result.unwrap(), ReadOutcome::Hit { len: bs });
    }
    for i in 0..16u64 {
        let got = arena.slice((16 + i as usize) * bs, bs).to_vec();
        assert!(got == data(i, bs), "arena block {i} differs");
    }
    assert_eq!(t.stats().bounce_copies, 0);
    drop(t);
    drop(arena);
}

#[test]
fn unaligned_raw_and_aligned_buffers_round_trip() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    let src = AlignedBuf::from_slice(&data(1, 12_288));
    t.write(key(1), IoBuf::Aligned(src)).wait().result.unwrap();
    let mut backing = vec![0u8; 20_000];
    // SAFETY: `backing` outlives the operation, which is waited for before it is used.
    let raw = unsafe { RawBuf::new(backing.as_mut_ptr().add(3), 12_288) };
    let done = t.read(key(1), IoBuf::Raw(raw)).wait();
    assert_eq!(done.result.unwrap(), ReadOutcome::Hit { len: 12_288 });
    assert!(backing[3..3 + 12_288] == data(1, 12_288)[..]);
    let done = t.read(key(1), IoBuf::Aligned(AlignedBuf::zeroed(0))).wait();
    assert_eq!(done.result.unwrap(), ReadOutcome::Hit { len: 12_288 });
    let IoBuf::Aligned(b) = done.buf else {
        panic!()
    };
    assert!(b[..] == data(1, 12_288)[..]);
}

#[test]
fn missing_keys_miss_and_small_destinations_are_refused() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    assert_eq!(read_vec(&t, 99).0, ReadOutcome::Miss(MissReason::NotFound));
    write_vec(&t, 5, 10_000);
    let mut tiny = [0u8; 100];
    // SAFETY: `tiny` outlives the waited operation.
    let raw = unsafe { RawBuf::new(tiny.as_mut_ptr(), tiny.len()) };
    let done = t.read(key(5), IoBuf::Raw(raw)).wait();
    assert!(matches!(
        done.result,
        Err(SpillError::BufferTooSmall { needed: 10_000, .. })
    ));
    assert!(t.delete(&key(5)));
    assert_eq!(read_vec(&t, 5).0, ReadOutcome::Miss(MissReason::NotFound));
}

#[test]
fn newer_write_of_a_key_wins() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    t.write(key(1), IoBuf::Vec(data(100, 5000)))
        .wait()
        .result
        .unwrap();
    write_vec(&t, 1, 7000);
    assert_block(&t, 1, 7000);
    assert_eq!(t.stats().blocks, 1);
}

#[test]
fn oversized_blocks_and_bad_configs_are_refused() {
    let d = TempDir::disk();
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    let done = t.write(key(1), IoBuf::Vec(vec![0; (256 << 10) + 1])).wait();
    assert!(matches!(done.result, Err(SpillError::TooLarge { .. })));
    assert!(matches!(
        SpillConfig::builder().build(),
        Err(SpillError::Config(_))
    ));
    let e = SpillConfig::builder()
        .dir(&d.0, 1 << 20)
        .region_size(1 << 20)
        .max_block_size(4096)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("two regions"), "{e}");
}

#[test]
fn many_blocks_across_two_dirs_with_concurrent_submitters() {
    let (a, b) = (TempDir::disk(), TempDir::disk());
    let cfg = SpillConfig::builder()
        .dir(&a.0, 32 << 20)
        .dir(&b.0, 32 << 20)
        .region_size(4 << 20)
        .max_block_size(64 << 10)
        .queue_depth(16)
        .build()
        .unwrap();
    let t = SpillTier::open(cfg).unwrap();
    std::thread::scope(|s| {
        for th in 0..4u64 {
            let t = &t;
            s.spawn(move || {
                let pending: Vec<_> = (0..200u64)
                    .map(|j| {
                        let i = th * 1000 + j;
                        t.write(
                            key(i),
                            IoBuf::Vec(data(i, 1000 + (i as usize * 37) % 60_000)),
                        )
                    })
                    .collect();
                for p in pending {
                    p.wait().result.unwrap();
                }
            });
        }
    });
    for th in 0..4u64 {
        for j in 0..200u64 {
            let i = th * 1000 + j;
            assert_block(&t, i, 1000 + (i as usize * 37) % 60_000);
        }
    }
    assert_eq!(t.stats().blocks, 800);
}
