//! Wire types: Dynamo's positional msgpack layout for KV events and batches (interop.md §1).

use serde::Serialize;
use serde::ser::{SerializeTuple, Serializer};

/// Prefix Dynamo expects before a cache salt in `extra_keys[0]`
/// (`DYNAMO_CACHE_SALT_PREFIX` in `dynamo_kv_router::zmq_wire`).
pub const CACHE_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// Slots a `BlockStored` array always carries: tag + 13 fields (tag .. ownership).
pub const BLOCK_STORED_SLOTS: usize = 14;
/// Slots a `BlockRemoved` array always carries: tag + 7 fields (tag .. ownership).
pub const BLOCK_REMOVED_SLOTS: usize = 8;
/// Slots an `AllBlocksCleared` array always carries: tag + ownership.
pub const ALL_BLOCKS_CLEARED_SLOTS: usize = 2;

/// The router hash of a page: the first 8 bytes of its SHA-256 digest, read big-endian.
///
/// `SGLang` emits the same bits as a signed i64; the router bit-casts either back to this u64.
pub fn router_hash(digest: &[u8; 32]) -> u64 {
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(head)
}

/// The tier a block lives in, as the router spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The pinned DRAM tier: `"CPU_PINNED"` (router tier `HostPinned`, eligible for hints).
    CpuPinned,
    /// The `NVMe` spill tier: `"DISK"` (router tier `Disk`; Dynamo 1.6.1 issues no hints for it).
    Disk,
}

impl Medium {
    /// The exact wire string. Any other spelling (`"cpu"`, `"nvme "`) is dropped by the router.
    pub fn as_wire(self) -> &'static str {
        match self {
            Self::CpuPinned => "CPU_PINNED",
            Self::Disk => "DISK",
        }
    }
}

impl Serialize for Medium {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_wire())
    }
}

/// Blocks that became resident in one tier, oldest (closest to the root) first.
///
/// `token_ids` holds the exact tokens of every block, concatenated:
/// `token_ids.len() == block_size * block_hashes.len()` (checked by validation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// Router hashes (see [`router_hash`]) of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// Router hash of the block before `block_hashes[0]`; `None` for a chain root.
    pub parent_block_hash: Option<u64>,
    /// Exact token ids of all blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block (the namespace's page size).
    pub block_size: u32,
    /// Tier the blocks became resident in.
    pub medium: Medium,
    /// Tenant salt; published as `extra_keys[0] = ["dynamo-cache-salt:" + salt]`.
    pub cache_salt: Option<String>,
}

impl BlockStored {
    /// A store of no blocks yet; add blocks with [`BlockStored::push_block`].
    pub fn new(medium: Medium, block_size: u32) -> Self {
        Self {
            block_hashes: Vec::new(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size,
            medium,
            cache_salt: None,
        }
    }

    /// Sets the parent (the block before the first one in this event).
    #[must_use]
    pub fn with_parent(mut self, parent: Option<u64>) -> Self {
        self.parent_block_hash = parent;
        self
    }

    /// Sets the tenant salt.
    #[must_use]
    pub fn with_salt(mut self, salt: Option<String>) -> Self {
        self.cache_salt = salt;
        self
    }

    /// Appends one block (its router hash and its exact tokens).
    pub fn push_block(&mut self, block_hash: u64, tokens: &[u32]) {
        self.block_hashes.push(block_hash);
        self.token_ids.extend_from_slice(tokens);
    }

    /// Appends one block, builder style.
    #[must_use]
    pub fn block(mut self, block_hash: u64, tokens: &[u32]) -> Self {
        self.push_block(block_hash, tokens);
        self
    }
}

/// Blocks that left one tier. The medium must repeat the one their store used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// Router hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Tier the blocks left.
    pub medium: Medium,
}

/// Every block this publisher (this DP rank) announced is gone, in every tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllBlocksCleared;

/// One KV event, before validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// See [`BlockStored`].
    Stored(BlockStored),
    /// See [`BlockRemoved`].
    Removed(BlockRemoved),
    /// See [`AllBlocksCleared`].
    Cleared(AllBlocksCleared),
}

impl KvEvent {
    /// The event's kind, for counters and logs.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Stored(_) => EventKind::Stored,
            Self::Removed(_) => EventKind::Removed,
            Self::Cleared(_) => EventKind::Cleared,
        }
    }

    /// Blocks the event names (0 for a clear).
    pub fn block_count(&self) -> usize {
        match self {
            Self::Stored(e) => e.block_hashes.len(),
            Self::Removed(e) => e.block_hashes.len(),
            Self::Cleared(_) => 0,
        }
    }
}

/// The three event kinds, in counter order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// `BlockStored`.
    Stored,
    /// `BlockRemoved`.
    Removed,
    /// `AllBlocksCleared`.
    Cleared,
}

impl EventKind {
    /// All kinds, in counter order.
    pub const ALL: [Self; 3] = [Self::Stored, Self::Removed, Self::Cleared];

    /// The wire tag, also used as the metrics label.
    pub fn tag(self) -> &'static str {
        match self {
            Self::Stored => "BlockStored",
            Self::Removed => "BlockRemoved",
            Self::Cleared => "AllBlocksCleared",
        }
    }
}

/// `extra_keys`: nil without a salt, else one entry per block with the salt alone in entry 0.
struct ExtraKeys<'a> {
    salt: &'a str,
    blocks: usize,
}

impl Serialize for ExtraKeys<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(self.blocks)?;
        t.serialize_element(&[SaltKey(self.salt)])?;
        for _ in 1..self.blocks {
            t.serialize_element(&None::<()>)?;
        }
        t.end()
    }
}

/// The tagged salt string, written without building it in a temporary `String`.
struct SaltKey<'a>(&'a str);

impl Serialize for SaltKey<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{CACHE_SALT_PREFIX}{}", self.0))
    }
}

const NIL: Option<()> = None;

impl Serialize for BlockStored {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(BLOCK_STORED_SLOTS)?;
        t.serialize_element(EventKind::Stored.tag())?; // 0 tag
        t.serialize_element(&self.block_hashes)?; // 1 block_hashes
        t.serialize_element(&self.parent_block_hash)?; // 2 parent_block_hash
        t.serialize_element(&self.token_ids)?; // 3 token_ids
        t.serialize_element(&self.block_size)?; // 4 block_size
        t.serialize_element(&NIL)?; // 5 lora_id (legacy)
        t.serialize_element(&self.medium)?; // 6 medium
        t.serialize_element(&NIL)?; // 7 lora_name: never the salt (seed §3)
        match &self.cache_salt {
            // 8 extra_keys
            Some(salt) => t.serialize_element(&ExtraKeys {
                salt,
                blocks: self.block_hashes.len(),
            })?,
            None => t.serialize_element(&NIL)?,
        }
        for _ in 9..BLOCK_STORED_SLOTS {
            // 9 group_idx, 10 kv_cache_spec_kind, 11 sliding_window, 12 locality, 13 ownership
            t.serialize_element(&NIL)?;
        }
        t.end()
    }
}

impl Serialize for BlockRemoved {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(BLOCK_REMOVED_SLOTS)?;
        t.serialize_element(EventKind::Removed.tag())?; // 0 tag
        t.serialize_element(&self.block_hashes)?; // 1 block_hashes
        t.serialize_element(&self.medium)?; // 2 medium
        for _ in 3..BLOCK_REMOVED_SLOTS {
            // 3 group_idx, 4 kind, 5 sliding_window, 6 locality, 7 ownership
            t.serialize_element(&NIL)?;
        }
        t.end()
    }
}

impl Serialize for AllBlocksCleared {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(ALL_BLOCKS_CLEARED_SLOTS)?;
        t.serialize_element(EventKind::Cleared.tag())?;
        t.serialize_element(&NIL)?; // ownership: nil is the framework's own residency
        t.end()
    }
}

impl Serialize for KvEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Stored(e) => e.serialize(s),
            Self::Removed(e) => e.serialize(s),
            Self::Cleared(e) => e.serialize(s),
        }
    }
}

/// Seconds since the Unix epoch, as the batch timestamp.
pub(crate) fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_hash_reads_first_eight_bytes_big_endian() {
        let mut digest = [0xEEu8; 32];
        digest[..8].copy_from_slice(&[0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]);
        assert_eq!(router_hash(&digest), 0x0123_4567_89AB_CDEF);
    }

    #[test]
    fn medium_spellings_are_exact() {
        assert_eq!(Medium::CpuPinned.as_wire(), "CPU_PINNED");
        assert_eq!(Medium::Disk.as_wire(), "DISK");
    }

    #[test]
    fn block_stored_fills_all_fourteen_slots_and_salts_extra_keys() {
        let ev = BlockStored::new(Medium::Disk, 2)
            .with_salt(Some("t".into()))
            .block(7, &[1, 2])
            .block(8, &[3, 4]);
        let bytes = rmp_serde::to_vec(&ev).unwrap();
        let value: rmpv::Value = rmp_serde::from_slice(&bytes).unwrap();
        let slots = value.as_array().unwrap();
        assert_eq!(slots.len(), BLOCK_STORED_SLOTS);
        assert_eq!(slots[0].as_str(), Some("BlockStored"));
        assert!(slots[5].is_nil() && slots[7].is_nil());
        assert_eq!(slots[6].as_str(), Some("DISK"));
        let extra = slots[8].as_array().unwrap();
        assert_eq!(extra.len(), 2);
        assert_eq!(
            extra[0].as_array().unwrap()[0].as_str(),
            Some("dynamo-cache-salt:t")
        );
        assert!(extra[1].is_nil());
        assert!(slots[9..].iter().all(rmpv::Value::is_nil));
    }

    #[test]
    fn removed_and_cleared_keep_their_slot_counts() {
        let rm = rmp_serde::to_vec(&BlockRemoved {
            block_hashes: vec![u64::MAX],
            medium: Medium::CpuPinned,
        })
        .unwrap();
        let rm: rmpv::Value = rmp_serde::from_slice(&rm).unwrap();
        assert_eq!(rm.as_array().unwrap().len(), BLOCK_REMOVED_SLOTS);
        assert_eq!(rm[1][0].as_u64(), Some(u64::MAX));
        let cl: rmpv::Value =
            rmp_serde::from_slice(&rmp_serde::to_vec(&AllBlocksCleared).unwrap()).unwrap();
        assert_eq!(cl.as_array().unwrap().len(), ALL_BLOCKS_CLEARED_SLOTS);
    }
}
