//! The memcpy baseline every host-memory benchmark is compared with.

use std::time::{Duration, Instant};

/// Single-thread memcpy bandwidth in bytes/s: `block`-sized copies whose source walks a
/// `src_pool`-byte buffer and whose destination walks a `dst_pool`-byte buffer, for at
/// least 1 s and two passes over the larger pool. A pool of one block stays cache-resident;
/// a pool much larger than the last-level cache is cold, so callers give the pools the
/// sizes the measured path uses, and both sides are equally cold or warm.
pub fn bandwidth(block: usize, src_pool: usize, dst_pool: usize) -> f64 {
    let block = block.max(1);
    let src_pool = src_pool.max(block);
    let dst_pool = dst_pool.max(block);
    let mut src = vec![0u8; src_pool];
    let mut dst = vec![0u8; dst_pool];
    kvnode_client::seeded::fill(7, &mut src);
    dst.fill(1);
    let (src_blocks, dst_blocks) = (src_pool / block, dst_pool / block);
    let (mut bytes, mut i) = (0u64, 0usize);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(1) || bytes < 2 * src_pool.max(dst_pool) as u64 {
        let s = (i % src_blocks) * block;
        let d = (i % dst_blocks) * block;
        dst[d..d + block].copy_from_slice(&src[s..s + block]);
        std::hint::black_box(&dst[d]);
        bytes += block as u64;
        i += 1;
    }
    bytes as f64 / t.elapsed().as_secs_f64()
}
