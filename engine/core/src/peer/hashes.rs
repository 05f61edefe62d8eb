//! Content hashes (BLAKE3) of the blocks this daemon sends or pulled, so a block is hashed at
//! most once however often it is served.
//!
//! The tier slot keeps a 64-bit fingerprint of the block (the first 8 bytes of its hash, in
//! the slot's checksum field) from the moment it is first hashed or verified; this table keeps
//! the full hash next to it, keyed by the slot's place and that fingerprint. A lookup whose
//! fingerprint differs (a new block in a reused slot) misses. When the table has lost an
//! entry, the block is hashed again and the new hash is checked against the slot's
//! fingerprint: bytes that changed since they were first hashed (a client scribbling on the
//! shared arena) are refused, never sent under a fresh hash. The hash is unkeyed: it is made
//! authentic by the session tag of the frame header that carries it, so a key roll needs no
//! invalidation here. Next to it the table keeps the block's MAC under one cluster key
//! (`kvnode_blockmac`), computed from the same bytes; a send under another key computes
//! both again.

use std::collections::HashMap;
use std::sync::Mutex;

use kvnode_proto::peer::HASH_LEN;
use kvnode_proto::{Digest, NamespaceId};

use kvnode_blockmac::TAG_LEN;

/// Entries kept before the table starts over (each about 130 bytes with the map's own: at
/// most ~17 MiB). Entries of evicted blocks linger until then; a lost entry costs one hash.
const CAP: usize = 1 << 17;

/// Where a block lives and what it was when first hashed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct SlotId {
    /// Namespace.
    pub ns: NamespaceId,
    /// Page digest.
    pub digest: Digest,
    /// Segment.
    pub segment: u16,
    /// Arena offset of the slot.
    pub offset: u64,
    /// Block length.
    pub len: u64,
    /// The fingerprint the slot keeps.
    pub fingerprint: u64,
}

/// The first 8 bytes of a hash, as kept in the tier slot.
pub fn fingerprint(h: &[u8; HASH_LEN]) -> u64 {
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// What is remembered of one block: its hash and, when computed, its MAC under one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sums {
    /// BLAKE3 of the bytes.
    pub hash: [u8; HASH_LEN],
    /// (cluster key id, POLYVAL tag) of the same bytes.
    pub tag: Option<(u64, [u8; TAG_LEN])>,
}

impl Sums {
    /// The tag under key `id`, if that is the one remembered.
    pub fn tag_for(&self, id: u64) -> Option<[u8; TAG_LEN]> {
        self.tag.filter(|(k, _)| *k == id).map(|(_, t)| t)
    }
}

/// Full hashes (and tags) by slot.
#[derive(Debug, Default)]
pub struct HashCache {
    map: Mutex<HashMap<SlotId, Sums>>,
}

impl HashCache {
    /// What is remembered for `s`.
    pub fn get(&self, s: &SlotId) -> Option<Sums> {
        self.map.lock().expect("hash cache lock").get(s).copied()
    }

    /// Remembers `h` for `s` (the table starts over when full).
    pub fn put(&self, s: SlotId, h: Sums) {
        let mut m = self.map.lock().expect("hash cache lock");
        if m.len() >= CAP {
            m.clear();
        }
        m.insert(s, h);
    }

    /// Forgets every hash (the next send of each block hashes it again).
    pub fn clear(&self) {
        self.map.lock().expect("hash cache lock").clear();
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.lock().expect("hash cache lock").len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
