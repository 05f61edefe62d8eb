//! The DRAM tier: block index, slot classes, leases and eviction over the shared arena.
//!
//! One mutex guards the metadata (index, slots, policies, counters). It is held for
//! hash-map work only: block bytes are copied outside it, under a lease. Invariants:
//! - a slot with `leases > 0` or in `Reserved` state is never evicted, freed or reused;
//! - a committed block's bytes never change (a key is committed at most once);
//! - a key is only ever looked up inside its own namespace.

mod copy;
mod demote;
pub mod image;
mod index;
pub mod pool;
mod state;

use std::sync::{Arc, Mutex};

use kvnode_proto::client::{CommitStatus, Extent, PutStatus, SegmentClass};
use kvnode_proto::stats::{NamespaceStats, PoolStats, TierStats};
use kvnode_proto::{BlockKey, Key, NamespaceId, NamespaceSpec};

use crate::policy::{BatchHint, PolicyKind, SlotId};
use crate::residency::{Announcer, RouterMeta};
pub use copy::CopyDown;
pub use demote::{DemoteEnd, Demotion, Finished};
use state::State;
pub use state::live::{PRE_COPY, PreCopy, PreCopyReport};
pub use state::quota::QuotaScope;
pub use state::retain::{RetainOutcome, RetainScope};

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
    /// A move down asked for on a daemon without a lower tier.
    #[error("this daemon has no NVMe tier (start it with --spill DIR): blocks cannot be demoted")]
    NoLowerTier,
    /// A delete while the spill index is rebuilt, with too many deleted keys remembered
    /// for it already; nothing changed.
    #[error(
        "the spill index is being rebuilt and {remembered} deleted keys are remembered for it already (at most {max}): nothing changed; retry once stats shows spill_recovering false"
    )]
    RecoveryBacklog {
        /// Keys remembered.
        remembered: usize,
        /// The most that are.
        max: usize,
    },
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

/// A slot reserved for a writer (raw: the store wraps it in a guard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
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
    /// Its place in the put that reserved it (the eviction policy's hint at commit).
    pub hint: BatchHint,
}

/// A leased block (raw: the store wraps it in a guard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leased {
    /// Slot (pass back to [`DramTier::release`]).
    pub slot: SlotId,
    /// Where the bytes are.
    pub extent: Extent,
    /// Fingerprint of the bytes (first 8 bytes of their BLAKE3 hash), if computed before
    /// (blocks are immutable, so it stays true).
    pub fingerprint: Option<u64>,
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
    /// A tier over `cfg.capacity` bytes of arena, announcing no events.
    pub fn new(cfg: &TierConfig) -> Self {
        Self::with_announcer(cfg, Announcer::new(None))
    }

    /// A tier whose residencies announce KV events through `announcer`.
    pub fn with_announcer(cfg: &TierConfig, announcer: Arc<Announcer>) -> Self {
        Self {
            state: Mutex::new(State::new(cfg, announcer)),
        }
    }

    /// Declares that a lower tier exists (evictions without a copy below count as dropped).
    pub fn set_has_lower(&self, yes: bool) {
        self.with(|s| s.has_lower = yes);
    }

    /// The namespace spec of a handle.
    pub fn namespace_spec(&self, ns: u32) -> Result<NamespaceSpec, TierError> {
        self.with(|s| s.ns(ns).map(|e| e.spec.clone()))
    }

    /// Free slot bytes (unassigned slabs plus free slots), and the tier's capacity.
    pub fn free_and_capacity(&self) -> (u64, u64) {
        self.with(|s| (s.free_bytes(), s.capacity_bytes()))
    }

    /// Picks blocks to demote while free bytes (counting moves in flight) are below `high`.
    pub fn pick_demotions(&self, max: usize, high: u64) -> Vec<Demotion> {
        self.with(|s| s.pick_demotions(max, high))
    }

    /// Ends a demotion; see [`Demotion`]. `on_lower` runs under the tier lock.
    pub fn finish_demotion(
        &self,
        d: &Demotion,
        end: DemoteEnd,
        on_lower: impl FnOnce(Option<&Arc<RouterMeta>>),
    ) -> Finished {
        self.with(|s| s.finish_demotion(d, end, on_lower))
    }

    /// Picks the named blocks for a demotion now, ending their holds; see
    /// [`Demotion`]. Also returns how many keys were not resident or not movable now.
    pub fn pick_keys(&self, ns: u32, keys: &[Key]) -> Result<(Vec<Demotion>, u32), TierError> {
        self.with(|s| s.pick_keys(ns, keys))
    }

    /// Holds the resident blocks of `keys` in DRAM for `ttl`, within `scope`'s quota.
    pub fn retain(
        &self,
        ns: u32,
        keys: &[Key],
        ttl: std::time::Duration,
        scope: RetainScope<'_>,
    ) -> Result<RetainOutcome, TierError> {
        self.with(|s| s.retain(ns, keys, ttl, scope))
    }

    /// Ends the holds on `keys`; returns how many were held.
    pub fn release_retention(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.with(|s| s.release_retention(ns, keys))
    }

    /// Whether each key is resident in DRAM.
    pub fn contains(&self, ns: u32, keys: &[Key]) -> Result<Vec<bool>, TierError> {
        self.with(|s| {
            s.ns(ns)?;
            Ok(keys
                .iter()
                .map(|k| s.find(ns, &k.0, k.1).is_some())
                .collect())
        })
    }

    /// Counts blocks promoted into DRAM.
    pub fn count_promotions(&self, n: u64) {
        self.with(|s| s.totals.promotions += n);
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

    /// Every registered namespace: handle, id and spec.
    pub fn namespaces(&self) -> Vec<(u32, NamespaceId, NamespaceSpec)> {
        self.with(|s| {
            (0u32..)
                .zip(&s.namespaces)
                .map(|(h, e)| (h, e.id, e.spec.clone()))
                .collect()
        })
    }

    /// The handle of a registered namespace id (peers name namespaces by id).
    pub fn handle_of(&self, id: NamespaceId) -> Option<u32> {
        self.with(|s| s.handle_of(id))
    }

    /// Reserves slots for `keys`; each either gets a reservation or a refusal status.
    pub(crate) fn reserve(
        &self,
        conn: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
    ) -> Result<Vec<Result<Reserved, PutStatus>>, TierError> {
        if keys.len() != lens.len() {
            return Err(TierError::LengthMismatch {
                keys: keys.len(),
                lens: lens.len(),
            });
        }
        self.with(|s| s.reserve(conn, ns, keys, lens))
    }

    /// Publishes a reserved slot as a block, announced with `meta` when it has one.
    /// `on_lower` marks a block promoted from the tier below; `fingerprint` is a checksum the
    /// caller verified the bytes against (kept, so sending the block on need not hash it).
    pub(crate) fn commit_one(
        &self,
        owner: u64,
        r: &Reserved,
        meta: Option<&Arc<RouterMeta>>,
        on_lower: bool,
        fingerprint: Option<u64>,
    ) -> CommitStatus {
        self.with(|s| s.commit_checked(owner, r, meta, on_lower, fingerprint))
    }

    /// Commits a reservation and leases the block under one lock (with its checksum, when
    /// given: a verified pull); `None` when it was not committed.
    pub(crate) fn commit_leased(
        &self,
        owner: u64,
        r: &Reserved,
        meta: Option<&Arc<RouterMeta>>,
        on_lower: bool,
        fingerprint: Option<u64>,
    ) -> Option<Leased> {
        self.with(|s| {
            (s.commit_checked(owner, r, meta, on_lower, fingerprint) == CommitStatus::Committed)
                .then(|| s.lease_slot(r.ns, r.slot, r.hint))
        })
    }

    /// Counts lookups that found a key below DRAM (planned, then promoted).
    pub(crate) fn count_misses(&self, ns: u32, n: u64) -> Result<(), TierError> {
        self.with(|s| s.count_misses(ns, n))
    }

    /// Records the checksum of a block the caller holds a lease on.
    pub(crate) fn remember_checksum(&self, b: &Leased, fingerprint: u64) {
        self.with(|s| s.set_checksum(b.slot, fingerprint));
    }

    /// Frees reserved slots without publishing them.
    pub(crate) fn abort(&self, conn: u64, res: &[Reserved]) {
        self.with(|s| res.iter().for_each(|r| s.abort(conn, r)));
    }

    /// Looks keys up and leases every hit; counts hits and misses.
    pub(crate) fn lease(&self, ns: u32, keys: &[Key]) -> Result<Vec<Option<Leased>>, TierError> {
        self.with(|s| s.lease(ns, keys))
    }

    /// Ends one lease on each slot.
    pub(crate) fn release(&self, slots: &[SlotId]) {
        self.with(|s| slots.iter().for_each(|&slot| s.release(slot)));
    }

    /// Length of each key's block if resident in DRAM (nothing leased).
    pub fn block_lens(&self, ns: u32, keys: &[Key]) -> Result<Vec<Option<u64>>, TierError> {
        self.with(|s| s.block_lens(ns, keys))
    }

    /// Number of leading keys present.
    pub fn exists(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.with(|s| s.exists(ns, keys))
    }

    /// Refreshes the leading run of `keys` held here in the eviction policy (blocks an engine
    /// holds on its GPU, whose hits never reach the daemon); returns the run's length.
    pub fn touch(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.with(|s| s.touch(ns, keys))
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
        self.with(|s| {
            s.expire_retention(std::time::Instant::now());
            s.snapshot()
        })
    }
}

/// Takeover: the tier as an image, and a tier rebuilt from one (image.rs).
impl DramTier {
    /// The image of the tier; refused unless it is quiescent (nothing reserved or moving).
    pub fn image(&self) -> Result<Vec<u8>, image::ImageError> {
        self.with(|s| s.image())
    }

    /// A tier rebuilt from `image`, announcing through `announcer`.
    pub fn restore(
        cfg: &TierConfig,
        announcer: Arc<Announcer>,
        image: &[u8],
    ) -> Result<Self, image::ImageError> {
        Ok(Self {
            state: Mutex::new(State::restore(cfg, announcer, image)?),
        })
    }
}

/// What taking a live image cost (`DramTier::live_image`).
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveImageStats {
    /// Blocks in the image (the others travel in the delta).
    pub blocks: u64,
    /// The longest time the tier's lock was held for one slab.
    pub max_hold: std::time::Duration,
    /// The whole walk.
    pub elapsed: std::time::Duration,
}

/// A takeover while serving (state/live.rs): an image taken one slab at a time while the
/// changed slots are noted, then the delta of those slots at the barrier.
impl DramTier {
    /// The tier's image, taken one slab at a time (the lock is held for one slab's blocks at
    /// most); from now on changed slots are noted until [`DramTier::delta`] or
    /// [`DramTier::stop_tracking`].
    pub fn live_image(&self) -> Result<(Vec<u8>, LiveImageStats), image::ImageError> {
        let t0 = std::time::Instant::now();
        let slabs = self.with(|s| {
            s.track();
            s.slabs.len() as u32
        });
        let mut stats = LiveImageStats::default();
        let mut body = Vec::new();
        // One slab's records, encoded under the lock into a buffer that stays allocated,
        // then appended outside it (a growing image is reallocated off the lock).
        let mut chunk = Vec::new();
        let mut classes = Vec::with_capacity(slabs as usize);
        for slab in 0..slabs {
            chunk.clear();
            let t = std::time::Instant::now();
            let (n, class) = self.with(|s| s.image_slab(slab, &mut chunk));
            stats.max_hold = stats.max_hold.max(t.elapsed());
            body.extend_from_slice(&chunk);
            stats.blocks += n;
            classes.push(class);
        }
        let header = self.with(|s| s.header(classes));
        let out = image::assemble(*b"KVNDRAM1", &header, stats.blocks, &body)?;
        stats.elapsed = t0.elapsed();
        Ok((out, stats))
    }

    /// Blocks held (cheap: no walk over the slots).
    pub fn blocks(&self) -> u64 {
        self.with(|s| s.totals.blocks)
    }

    /// Stops noting changed slots (the successor of a live image went away).
    pub fn stop_tracking(&self) {
        self.with(State::untrack);
    }

    /// The slots changed since [`DramTier::live_image`], with their blocks now; tracking
    /// ends. Call only once no request, demotion or copy can run.
    pub fn delta(&self) -> Result<Vec<u8>, image::ImageError> {
        self.with(State::delta)
    }

    /// A pre-copy round while serving: the slots changed since [`DramTier::live_image`] or
    /// the last round, with their state now; tracking goes on. Returns the delta and how
    /// many slots it names (the lock is held for those slots).
    pub fn delta_round(&self) -> Result<(Vec<u8>, u64), image::ImageError> {
        self.with(State::delta_round)
    }

    /// Applies a donor's [`DramTier::delta`] (the barrier's) to this tier, restored from
    /// its live image and the rounds before. Returns the slots it named. On an error the
    /// tier is unusable.
    pub fn apply_delta(&self, delta: &[u8]) -> Result<u64, image::ImageError> {
        self.with(|s| s.apply_delta(delta, false))
    }

    /// Applies a donor's [`DramTier::delta_round`] (before the barrier; the free lists are
    /// filtered exactly). Returns the slots it named. On an error the tier is unusable.
    pub fn apply_round(&self, delta: &[u8]) -> Result<u64, image::ImageError> {
        self.with(|s| s.apply_delta(delta, true))
    }
}

/// Copies down that leave the block in DRAM (stop-time flush, write-behind); see copy.rs.
impl DramTier {
    /// Turns the write-behind queue on (every later commit is queued for a copy down, and
    /// so is every block already here without one, e.g. after a takeover).
    pub fn set_write_behind(&self, on: bool) {
        self.with(|s| {
            s.write_behind.on = on;
            s.write_behind.queue.clear();
            if on {
                let now = std::time::Instant::now();
                let mut held: Vec<(SlotId, BlockKey)> =
                    s.indexed().map(|(slot, r)| (slot, s.key_of(r))).collect();
                held.sort_unstable_by_key(|e| e.0);
                s.write_behind
                    .queue
                    .extend(held.into_iter().map(|(slot, k)| (slot, k, now)));
            }
        });
    }

    /// Up to `max` queued blocks committed at or before `before`, marked as being copied.
    pub fn pick_write_behind(&self, max: usize, before: std::time::Instant) -> Vec<CopyDown> {
        self.with(|s| s.pick_write_behind(max, before))
    }

    /// Queues every block committed from now on for a copy down, keeping what is queued
    /// (the stop-time copy while serving: store/flush.rs).
    pub fn track_commits(&self) {
        self.with(State::track_commits);
    }

    /// Blocks queued for a copy down.
    pub fn queued_copies(&self) -> usize {
        self.with(|s| s.queued_copies())
    }

    /// Commit time of the oldest block still queued for write-behind.
    pub fn oldest_write_behind(&self) -> Option<std::time::Instant> {
        self.with(|s| s.oldest_write_behind())
    }

    /// Up to `max` blocks with no copy below, marked as being copied.
    pub fn pick_uncopied(&self, max: usize, has_copy: &dyn Fn(&BlockKey) -> bool) -> Vec<CopyDown> {
        self.with(|s| s.pick_uncopied(max, has_copy))
    }

    /// Up to `max` blocks with no copy below, marked as being copied, walking at most
    /// `scan` slots in arena order from `from`; where to go on from (`None`: at the end).
    pub fn pick_uncopied_from(
        &self,
        from: SlotId,
        max: usize,
        scan: usize,
        has_copy: &dyn Fn(&BlockKey) -> bool,
    ) -> (Vec<CopyDown>, Option<SlotId>) {
        self.with(|s| s.pick_uncopied_from(from, max, scan, has_copy))
    }

    /// Blocks with no copy below (and none under way).
    pub fn count_uncopied(&self, has_copy: &dyn Fn(&BlockKey) -> bool) -> u64 {
        self.with(|s| s.count_uncopied(has_copy))
    }

    /// Ends a copy down; `true` when the block was deleted meanwhile.
    pub fn finish_copy(
        &self,
        c: &CopyDown,
        ok: bool,
        on_lower: impl FnOnce(Option<&Arc<RouterMeta>>),
    ) -> bool {
        self.with(|s| s.finish_copy(c, ok, on_lower))
    }
}

#[cfg(test)]
mod heap_tests;
#[cfg(test)]
mod image_tests;
#[cfg(test)]
mod live_tests;
#[cfg(test)]
mod test_fixtures;
#[cfg(test)]
mod tests;
