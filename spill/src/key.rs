//! The block key the spill tier stores blocks under.

/// Identity of a spilled block: `(namespace, page digest, segment)`, as the engine defines it.
///
/// The spill tier treats it as opaque bytes; it is stored verbatim in every block header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpillKey {
    /// 128-bit digest of everything that changes the block's bytes (model, layout, shard, tenant).
    pub namespace: u128,
    /// The engine's chained page digest.
    pub digest: [u8; 32],
    /// Segment of the page (a page may be split into several blocks).
    pub segment: u16,
}
