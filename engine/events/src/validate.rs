//! Validation: every event is checked before it may join a batch, so one bad event never drops a batch.

use std::collections::HashSet;

use serde::{Serialize, Serializer};

use crate::wire::{BlockRemoved, BlockStored, CACHE_SALT_PREFIX, EventKind, KvEvent};

/// Why an event was refused before batching. The router would otherwise drop it, or the
/// whole batch it sits in, or index it wrongly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// A store or remove with no block hashes: the router learns nothing from it.
    #[error("{kind} names no blocks; send an event only when at least one block changed")]
    EmptyBlockHashes {
        /// The refused event's kind tag.
        kind: &'static str,
    },
    /// `block_size` is 0; the router could not split `token_ids` into blocks.
    #[error("BlockStored has block_size 0; pass the namespace's page size in tokens")]
    ZeroBlockSize,
    /// `token_ids.len() != block_size * block_hashes.len()`: the router re-hashes the tokens,
    /// so a short or long list silently drops or mis-indexes blocks.
    #[error(
        "BlockStored carries {actual} token ids but {blocks} blocks of {block_size} need \
         {expected}; attach the exact tokens of every block"
    )]
    TokenCountMismatch {
        /// Tokens the event carries.
        actual: usize,
        /// `block_size * blocks`.
        expected: u64,
        /// Blocks in the event.
        blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
    /// A hash appears twice in one store (or equals the parent): the router drops the
    /// whole store as self-referencing.
    #[error("BlockStored repeats block hash {hash:#018x} (or uses it as its own parent)")]
    DuplicateBlockHash {
        /// The repeated router hash.
        hash: u64,
    },
    /// A salt of `""`: the router reads it as "no salt" and would index the blocks unsalted.
    #[error("BlockStored has an empty cache salt; pass None for unsalted namespaces")]
    EmptySalt,
}

/// The rejection reasons without their data: counter slots and metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// [`Rejection::EmptyBlockHashes`].
    EmptyBlockHashes,
    /// [`Rejection::ZeroBlockSize`].
    ZeroBlockSize,
    /// [`Rejection::TokenCountMismatch`].
    TokenCountMismatch,
    /// [`Rejection::DuplicateBlockHash`].
    DuplicateBlockHash,
    /// [`Rejection::EmptySalt`].
    EmptySalt,
}

impl RejectReason {
    /// All reasons, in counter order.
    pub const ALL: [Self; 5] = [
        Self::EmptyBlockHashes,
        Self::ZeroBlockSize,
        Self::TokenCountMismatch,
        Self::DuplicateBlockHash,
        Self::EmptySalt,
    ];

    /// Snake-case label for metrics (`kvnode_events_rejected_total{reason=...}`).
    pub fn label(self) -> &'static str {
        match self {
            Self::EmptyBlockHashes => "empty_block_hashes",
            Self::ZeroBlockSize => "zero_block_size",
            Self::TokenCountMismatch => "token_count_mismatch",
            Self::DuplicateBlockHash => "duplicate_block_hash",
            Self::EmptySalt => "empty_salt",
        }
    }

    /// Position in [`RejectReason::ALL`] (and in counter arrays).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Rejection {
    /// The reason without its data.
    pub fn reason(&self) -> RejectReason {
        match self {
            Self::EmptyBlockHashes { .. } => RejectReason::EmptyBlockHashes,
            Self::ZeroBlockSize => RejectReason::ZeroBlockSize,
            Self::TokenCountMismatch { .. } => RejectReason::TokenCountMismatch,
            Self::DuplicateBlockHash { .. } => RejectReason::DuplicateBlockHash,
            Self::EmptySalt => RejectReason::EmptySalt,
        }
    }
}

/// An event that passed [`validate`]. Only this type can enter a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidEvent(KvEvent);

impl ValidEvent {
    /// The validated event.
    pub fn event(&self) -> &KvEvent {
        &self.0
    }

    /// Gives the event back.
    pub fn into_event(self) -> KvEvent {
        self.0
    }

    /// Bytes its account is charged while it is queued and while its batch is kept for
    /// replay: an upper bound of both its heap (4 bytes a token, 8 a hash) and its msgpack
    /// encoding (at most 5 bytes a token, 9 a hash, the tagged salt once and a nil per
    /// further block), plus a fixed [`EVENT_OVERHEAD`].
    pub fn footprint(&self) -> u64 {
        let var = match &self.0 {
            KvEvent::Stored(e) => {
                5 * e.token_ids.len()
                    + 10 * e.block_hashes.len()
                    + e.cache_salt
                        .as_ref()
                        .map_or(0, |s| s.len() + CACHE_SALT_PREFIX.len())
            }
            KvEvent::Removed(e) => 9 * e.block_hashes.len(),
            KvEvent::Cleared(_) => 0,
        };
        (var + EVENT_OVERHEAD) as u64
    }
}

/// Fixed bytes charged per event on top of [`ValidEvent::footprint`]'s variable part: the
/// queue slot, the tag, the nil slots and the array headers on the wire.
pub const EVENT_OVERHEAD: usize = 128;

impl Serialize for ValidEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl TryFrom<KvEvent> for ValidEvent {
    type Error = Rejection;

    fn try_from(event: KvEvent) -> Result<Self, Rejection> {
        validate(event)
    }
}

/// Checks an event against every rule the router enforces by dropping data.
pub fn validate(event: KvEvent) -> Result<ValidEvent, Rejection> {
    match &event {
        KvEvent::Stored(e) => check_stored(e)?,
        KvEvent::Removed(e) => check_removed(e)?,
        KvEvent::Cleared(_) => {}
    }
    Ok(ValidEvent(event))
}

fn check_stored(e: &BlockStored) -> Result<(), Rejection> {
    let blocks = e.block_hashes.len();
    if blocks == 0 {
        return Err(Rejection::EmptyBlockHashes {
            kind: EventKind::Stored.tag(),
        });
    }
    if e.block_size == 0 {
        return Err(Rejection::ZeroBlockSize);
    }
    let expected = u64::from(e.block_size) * blocks as u64;
    if e.token_ids.len() as u64 != expected {
        return Err(Rejection::TokenCountMismatch {
            actual: e.token_ids.len(),
            expected,
            blocks,
            block_size: e.block_size,
        });
    }
    if let Some(hash) = first_duplicate(e.parent_block_hash, &e.block_hashes) {
        return Err(Rejection::DuplicateBlockHash { hash });
    }
    if e.cache_salt.as_deref() == Some("") {
        return Err(Rejection::EmptySalt);
    }
    Ok(())
}

fn check_removed(e: &BlockRemoved) -> Result<(), Rejection> {
    if e.block_hashes.is_empty() {
        return Err(Rejection::EmptyBlockHashes {
            kind: EventKind::Removed.tag(),
        });
    }
    Ok(())
}

/// The first hash that repeats among `parent` and `hashes`. Quadratic for the common
/// short event (one block per residency), a set beyond that.
fn first_duplicate(parent: Option<u64>, hashes: &[u64]) -> Option<u64> {
    const LINEAR_MAX: usize = 16;
    if hashes.len() <= LINEAR_MAX {
        for (i, h) in hashes.iter().enumerate() {
            if parent == Some(*h) || hashes[..i].contains(h) {
                return Some(*h);
            }
        }
        return None;
    }
    let mut seen: HashSet<u64> = HashSet::with_capacity(hashes.len() + 1);
    seen.extend(parent);
    hashes.iter().copied().find(|h| !seen.insert(*h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{AllBlocksCleared, Medium};

    fn stored(hashes: &[u64], block_size: u32) -> BlockStored {
        let mut e = BlockStored::new(Medium::CpuPinned, block_size);
        for h in hashes {
            e.push_block(*h, &vec![1; block_size as usize]);
        }
        e
    }

    #[test]
    fn well_formed_events_pass() {
        assert!(validate(KvEvent::Stored(stored(&[1, 2], 4).with_parent(Some(9)))).is_ok());
        let rm = BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::Disk,
        };
        assert!(validate(KvEvent::Removed(rm)).is_ok());
        assert!(validate(KvEvent::Cleared(AllBlocksCleared)).is_ok());
    }

    #[test]
    fn token_count_must_match_blocks_times_block_size() {
        let mut e = stored(&[1, 2], 4);
        e.token_ids.pop();
        let err = validate(KvEvent::Stored(e)).unwrap_err();
        assert_eq!(err.reason(), RejectReason::TokenCountMismatch);
        assert!(err.to_string().contains("7 token ids"), "{err}");
    }

    #[test]
    fn empty_zero_duplicate_and_empty_salt_are_refused() {
        let cases = [
            (stored(&[], 4), RejectReason::EmptyBlockHashes),
            (
                BlockStored::new(Medium::Disk, 0).block(1, &[]),
                RejectReason::ZeroBlockSize,
            ),
            (stored(&[3, 4, 3], 1), RejectReason::DuplicateBlockHash),
            (
                stored(&[3], 1).with_parent(Some(3)),
                RejectReason::DuplicateBlockHash,
            ),
            (
                stored(&[3], 1).with_salt(Some(String::new())),
                RejectReason::EmptySalt,
            ),
        ];
        for (event, reason) in cases {
            assert_eq!(
                validate(KvEvent::Stored(event)).unwrap_err().reason(),
                reason
            );
        }
        let rm = BlockRemoved {
            block_hashes: vec![],
            medium: Medium::CpuPinned,
        };
        let err = validate(KvEvent::Removed(rm)).unwrap_err();
        assert_eq!(err.reason(), RejectReason::EmptyBlockHashes);
    }

    #[test]
    fn duplicate_search_agrees_between_short_and_long_events() {
        let long: Vec<u64> = (0..40).chain([17]).collect();
        assert_eq!(first_duplicate(None, &long), Some(17));
        assert_eq!(first_duplicate(Some(39), &long[..40]), Some(39));
        assert_eq!(first_duplicate(None, &long[..40]), None);
    }

    #[test]
    fn reason_indices_match_their_position() {
        for (i, r) in RejectReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
