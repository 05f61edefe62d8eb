//! How a trace block becomes a kvnode page: its key (router hash = the trace's block id), its
//! bytes (derived from the id, so every read can be checked) and its router metadata; and the
//! engine's GPU prefix cache, an LRU over block ids.

use std::collections::{BTreeMap, HashMap};

use kvnode_proto::client::BlockMeta;
use kvnode_proto::{Digest, Key};

/// Seed of every block's bytes.
const SEED: u64 = 0x7265_706c_6179_3430;

/// Tokens a page is announced with (the namespace's `page_size`): the events need tokens,
/// the replay needs none of their values.
pub const PAGE_TOKENS: u32 = 16;

/// The key of trace block `id`: its router hash is `id`.
pub fn key(id: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&id.to_be_bytes());
    d[8] = 0x40;
    Key::page(Digest(d))
}

/// The bytes block `id` is stored as.
pub fn content(id: u64, len: usize) -> Vec<u8> {
    kvnode_client::seeded::bytes(SEED, &key(id).0, len)
}

/// Router metadata of block `id`, chained to `parent`.
pub fn meta(id: u64, parent: Option<u64>) -> BlockMeta {
    BlockMeta {
        tokens: (0..PAGE_TOKENS)
            .map(|t| (id as u32).wrapping_mul(31).wrapping_add(t))
            .collect(),
        parent: parent.map(|p| key(p).0),
    }
}

/// An engine's GPU prefix cache: LRU over block ids, `capacity` blocks (0: none).
#[derive(Debug, Default)]
pub struct GpuCache {
    capacity: usize,
    clock: u64,
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl GpuCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Leading blocks of `blocks` held.
    pub fn leading(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.at.contains_key(b))
            .count()
    }

    /// After a prefill every block of the request is in GPU memory: touch them in order.
    pub fn admit(&mut self, blocks: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for &b in blocks {
            self.clock += 1;
            if let Some(old) = self.at.insert(b, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, b);
            if self.at.len() > self.capacity
                && let Some((_, victim)) = self.order.pop_first()
            {
                self.at.remove(&victim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_cache_keeps_the_most_recent_blocks() {
        let mut g = GpuCache::new(3);
        g.admit(&[1, 2, 3]);
        g.admit(&[1, 4]);
        assert_eq!(g.leading(&[1, 4, 3]), 3);
        assert_eq!(g.leading(&[2]), 0, "2 was least recent");
        assert_eq!(GpuCache::new(0).leading(&[1]), 0);
    }

    #[test]
    fn a_key_carries_its_block_id_as_router_hash() {
        assert_eq!(key(123_456).0.router_hash(), 123_456);
        assert_ne!(content(1, 64), content(2, 64));
    }
}
