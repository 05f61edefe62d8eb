//! Pins the DRAM tier's heap per block (issue 42 item 3: at most 128 bytes at 10 M blocks).
//!
//! This test binary's global allocator counts the bytes each thread holds; a test fills a
//! tier of 4 KiB slots (64 MiB slabs, the daemon's default slab at that size) with 4 KiB
//! blocks and divides what the tier holds then (slots, index, policy, free lists, counters)
//! by the blocks. Deterministic: no RSS, no other thread's allocations.
//! Run: `cargo test --release -p kvnode-engine --lib dram::heap_tests -- --nocapture`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use super::test_fixtures::*;
use super::*;

/// Counts every allocation of the thread that makes it (net bytes held).
struct Counting;

thread_local! {
    static HELD: Cell<u64> = const { Cell::new(0) };
}

/// Counts `add` bytes allocated and `sub` freed (wrapping: only differences are read).
fn count(add: usize, sub: usize) {
    // During a thread's teardown its counter may be gone: nothing to count then.
    let _ = HELD.try_with(|h| h.set(h.get().wrapping_add(add as u64).wrapping_sub(sub as u64)));
}

fn held() -> u64 {
    HELD.with(Cell::get)
}

// SAFETY: every call is forwarded to `System` unchanged; only a thread-local counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, forwarded.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            count(l.size(), 0);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, forwarded.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            count(l.size(), 0);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract for `dealloc`, forwarded.
        unsafe { System.dealloc(p, l) };
        count(0, l.size());
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, forwarded.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            count(new, l.size());
        }
        q
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

const PAGE: u64 = 4096;
const SLAB: u64 = 64 * MIB;

/// Heap bytes per block of a tier (`policy`) holding `blocks` blocks of 4 KiB, every slot
/// of its slabs but the last one's tail in use.
fn heap_per_block(blocks: u32, policy: PolicyKind) -> f64 {
    let per_slab = SLAB / PAGE;
    let capacity = u64::from(blocks).div_ceil(per_slab) * SLAB;
    let before = held();
    let t = DramTier::new(&TierConfig {
        capacity,
        slab_bytes: SLAB,
        policy,
    });
    let ns = t.register(&spec("heap", PAGE)).unwrap().ns;
    for i in 0..blocks {
        let r = t
            .reserve(1, ns, &[key(i)], &[PAGE])
            .unwrap()
            .remove(0)
            .unwrap();
        assert_eq!(
            t.commit_one(1, &r, None, false, None),
            CommitStatus::Committed
        );
    }
    let per = held().wrapping_sub(before) as f64 / f64::from(blocks);
    assert_eq!(t.snapshot().tier.blocks, u64::from(blocks));
    assert_eq!(t.exists(ns, &[key(0), key(blocks - 1)]).unwrap(), 2);
    drop(t);
    println!("{policy:?}: {blocks} blocks of 4 KiB, {per:.1} heap bytes per block");
    per
}

#[test]
fn the_dram_tier_holds_at_most_128_heap_bytes_per_block() {
    // 2^20 blocks is the index's worst fill (its table just doubled); 10 M is the target.
    for blocks in [1 << 20, 10_000_000] {
        let per = heap_per_block(blocks, PolicyKind::Lru);
        assert!(
            per <= 128.0,
            "{per:.1} heap bytes per block at {blocks} blocks (LRU): the DRAM tier's layout grew (docs/architecture.md, \"DRAM index\")"
        );
    }
}

#[test]
fn every_eviction_policy_keeps_the_tier_within_bounds() {
    // S3-FIFO keeps queue items and ghosts, chain a priority order (a B-tree) and ghosts:
    // more than LRU (before issue 42: 372 and 406 bytes).
    for (policy, bound) in [(PolicyKind::S3fifo, 128.0), (PolicyKind::Chain, 160.0)] {
        let per = heap_per_block(1 << 20, policy);
        assert!(per <= bound, "{per:.1} heap bytes per block ({policy:?})");
    }
}
