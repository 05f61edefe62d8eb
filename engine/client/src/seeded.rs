//! Deterministic page bytes (splitmix64), shared by the CLI's `put --seed` and the benchmarks.

use kvnode_proto::Digest;

/// Deterministic bytes for a page: a splitmix64 stream seeded by `seed` and the digest.
pub fn bytes(seed: u64, digest: &Digest, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill(seed ^ digest.router_hash(), &mut out);
    out
}

/// Fills `buf` from a splitmix64 stream.
pub fn fill(seed: u64, buf: &mut [u8]) {
    let mut x = seed;
    for chunk in buf.chunks_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}
