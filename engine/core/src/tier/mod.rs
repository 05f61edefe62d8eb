//! The DRAM tier: block index, slot classes, leases and eviction over the shared arena.
//!
//! One mutex guards the metadata (index, slots, policies, counters). It is held for
//! hash-map work only: block bytes are copied outside it, under a lease. Invariants:
//! - a slot with `leases > 0` or in `Reserved` state is never evicted, freed or reused;
//! - a committed block's bytes never change (a key is committed at most once);
//! - a key is only ever looked up inside its own namespace.

pub mod pool;
mod state;

use std::sync::Mutex;

use kvnode_proto::client::{CommitStatus, Extent, PutStatus, SegmentClass};
use kvnode_proto::stats::{NamespaceStats, PoolStats, TierStats};
use kvnode_proto::{BlockKey, Key, NamespaceId, NamespaceSpec};

use crate::policy::{PolicyKind, SlotId};
use state::State;

/// A request the tier refuses as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// No namespace with this handle.
    #[error(
        "unknown namespace handle {0}: register the namespace on this connection's daemon first"
    )]
    UnknownNamespace(u32),
    /// The namespace spec is invalid.
    #[error("invalid namespace spec: {0}")]
    Spec(#[from] kvnode_proto::namespace::SpecError),
    /// A segment slot is larger than a slab.
    #[error(
        "segment {segment} slot size {size} exceeds the slab size {slab}: raise `slab_size` in the daemon config"
    )]
    SlotTooLarge {
        /// Segment.
        segment: usize,
        /// Declared size.
        size: u64,
        /// Slab size.
        slab: u64,
    },
    /// Too many slot classes.
    #[error("too many distinct slot sizes ({0}); the daemon supports at most 4096 classes")]
    TooManyClasses(usize),
    /// `keys` and `lens` differ in length.
    #[error("{keys} keys but {lens} lengths")]
    LengthMismatch {
        /// Keys given.
        keys: usize,
        /// Lengths given.
        lens: usize,
    },
}

/// Tier sizing and policy.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Bytes of arena the tier manages.
    pub capacity: u64,
    /// Slab size: the unit moved between slot classes, and the largest slot.
    pub slab_bytes: u64,
    /// Eviction policy of every class.
    pub policy: PolicyKind,
}

/// A slot reserved for a writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Slot.
    pub slot: SlotId,
    /// Key it will hold.
    pub key: BlockKey,
    /// Namespace handle.
    pub ns: u32,
    /// Arena byte offset.
    pub offset: u64,
    /// Bytes to write.
    pub len: u64,
}

/// A leased block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasedBlock {
    /// Slot (pass back to [`DramTier::release`]).
    pub slot: SlotId,
    /// Where the bytes are.
    pub extent: Extent,
}

/// Result of a registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Handle.
    pub ns: u32,
    /// Namespace id.
    pub id: NamespaceId,
    /// Slot class per segment.
    pub segments: Vec<SegmentClass>,
}

/// A consistent snapshot of the tier's counters.
#[derive(Debug, Clone, Default)]
pub struct TierSnapshot {
    /// Tier totals.
    pub tier: TierStats,
    /// Per class.
    pub pools: Vec<PoolStats>,
    /// Per namespace.
    pub namespaces: Vec<NamespaceStats>,
}

/// The DRAM tier.
#[derive(Debug)]
pub struct DramTier {
    state: Mutex<State>,
}

impl DramTier {
    /// A tier over `cfg.capacity` bytes of arena.
    pub fn new(cfg: &TierConfig) -> Self {
        Self {
            state: Mutex::new(State::new(cfg)),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        // A poisoned lock means a panic mid-update: the metadata can no longer be trusted,
        // so propagate rather than serve possibly wrong blocks.
        let mut g = self
            .state
            .lock()
            .expect("DRAM tier metadata lock poisoned by a panic");
        f(&mut g)
    }

    /// Registers (idempotently) a namespace.
    pub fn register(&self, spec: &NamespaceSpec) -> Result<Registered, TierError> {
        self.with(|s| s.register(spec))
    }

    /// The id of a handle.
    pub fn namespace_id(&self, ns: u32) -> Result<NamespaceId, TierError> {
        self.with(|s| s.ns(ns).map(|e| e.id))
    }

    /// The handle of a registered namespace id (peers name namespaces by id).
    pub fn handle_of(&self, id: NamespaceId) -> Option<u32> {
        self.with(|s| s.handle_of(id))
    }

    /// Reserves slots for `keys`; each either gets a reservation or a refusal status.
    pub fn reserve(
        &self,
        conn: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
    ) -> Result<Vec<Result<Reservation, PutStatus>>, TierError> {
        if keys.len() != lens.len() {
            return Err(TierError::LengthMismatch {
                keys: keys.len(),
                lens: lens.len(),
            });
        }
        self.with(|s| s.reserve(conn, ns, keys, lens))
    }

    /// Publishes reserved slots as blocks.
    pub fn commit(&self, conn: u64, res: &[Reservation]) -> Vec<CommitStatus> {
        self.with(|s| res.iter().map(|r| s.commit(conn, r)).collect())
    }

    /// Frees reserved slots without publishing them.
    pub fn abort(&self, conn: u64, res: &[Reservation]) {
        self.with(|s| res.iter().for_each(|r| s.abort(conn, r)));
    }

    /// Looks keys up and leases every hit; counts hits and misses.
    pub fn lease(&self, ns: u32, keys: &[Key]) -> Result<Vec<Option<LeasedBlock>>, TierError> {
        self.with(|s| s.lease(ns, keys))
    }

    /// Ends one lease on each slot.
    pub fn release(&self, slots: &[SlotId]) {
        self.with(|s| slots.iter().for_each(|&slot| s.release(slot)));
    }

    /// Number of leading keys present.
    pub fn exists(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.with(|s| s.exists(ns, keys))
    }

    /// Removes keys; returns how many were present.
    pub fn delete(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.with(|s| s.delete(ns, keys))
    }

    /// Removes every block of `ns` (or of all namespaces); returns how many.
    pub fn clear(&self, ns: Option<u32>) -> Result<u64, TierError> {
        self.with(|s| s.clear(ns))
    }

    /// Counters.
    pub fn snapshot(&self) -> TierSnapshot {
        self.with(|s| s.snapshot())
    }
}

#[cfg(test)]
mod tests;
