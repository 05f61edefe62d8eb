//! What the DRAM tier's unit tests share: a tier config, a namespace spec, keys.

use kvnode_proto::{Digest, Key, NamespaceSpec};

use super::TierConfig;
use crate::policy::PolicyKind;

pub(super) const MIB: u64 = 1 << 20;

/// A tier of `capacity` bytes in 2 MiB slabs, LRU.
pub(super) fn cfg(capacity: u64) -> TierConfig {
    TierConfig {
        capacity,
        slab_bytes: 2 * MIB,
        policy: PolicyKind::Lru,
    }
}

/// A one-segment namespace of `slot`-byte blocks.
pub(super) fn spec(model: &str, slot: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: model.into(),
        page_size: 16,
        segments: vec![slot],
        ..Default::default()
    }
}

/// A distinct key per `i`.
pub(super) fn key(i: u32) -> Key {
    let mut d = [0u8; 32];
    d[..4].copy_from_slice(&i.to_be_bytes());
    Key(Digest(d), 0)
}
