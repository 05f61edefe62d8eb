//! The NVMe spill tier as the engine uses it: a plain adapter over `kvnode-spill` that knows
//! nothing of DRAM. Reads into arena slots (`submit_read`/`finish_read`), the one write path
//! (`write_block`, write.rs), `contains`/`delete`/`clear`, the DISK residencies announced as
//! KV events, the per-tenant NVMe ledger (quota.rs), stats.
//!
//! ```text
//!  store/ (demote.rs, write_behind.rs, flush.rs, promote.rs): which block moves, and when
//!     │ write_block(key, arena offset, len)      │ submit_read / finish_read
//!     v                                          v
//!  NvmeTier ──> SpillTier (kvnode-spill: io_uring O_DIRECT, fixed buffers = the arena)
//! ```
//!
//! Spill keys use the 128-bit [`kvnode_proto::NamespaceId`], never the per-process handle,
//! so after a restart the rebuilt spill index serves a namespace as soon as a client
//! registers it again. The DRAM tier never imports the spill crate, and this module never
//! imports the DRAM tier: the store joins them.

pub mod config;
mod quota;
mod write;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvnode_events::Medium;
use kvnode_proto::stats::TierStats;
use kvnode_proto::{BlockKey, Key, NamespaceId};
use kvnode_spill::{
    ArenaSlice, IoBuf, IoEngineKind, MissReason, ReadOutcome, SpillConfig, SpillError, SpillKey,
    SpillOpening, SpillTier,
};

use crate::obs::Metrics;
use crate::residency::{Announcer, Residency, RouterMeta};
use config::{SpillEngine, SpillSettings};

pub use quota::QuotaRoom;
pub use write::{CopyCounters, InFlight};

/// Counters of the NVMe tier kept by the engine (the spill crate keeps its own IO counters).
#[derive(Debug, Default)]
struct Counters {
    promotions: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    errors: AtomicU64,
    evictions: AtomicU64,
    queue_full: AtomicU64,
}

/// The spill tier as the engine uses it.
#[derive(Debug)]
pub struct NvmeTier {
    spill: SpillTier,
    settings: SpillSettings,
    announcer: Arc<Announcer>,
    /// DISK residencies of blocks with router metadata (lock order: DRAM tier, then this).
    residencies: Mutex<HashMap<SpillKey, Residency>>,
    counters: Counters,
    in_flight: AtomicUsize,
    progress: tokio::sync::Notify,
    metrics: Arc<Metrics>,
    /// Per-tenant NVMe bytes and quotas (set once by the engine when a tenant map is on).
    quota: quota::NvmeQuota,
    /// Copies down that keep the block in DRAM (store/write_behind.rs, store/flush.rs).
    copies: CopyCounters,
    /// Promotion windows in flight, measured together (the `nvme_read` path's figure).
    promotions: crate::obs::cost::Overlapped,
}

/// One promotion window being timed ([`NvmeTier::promoting`]); dropping it ends the window
/// (also when its get is dropped part-way).
#[derive(Debug)]
pub struct Promoting<'a> {
    tier: &'a NvmeTier,
    bytes: u64,
}

impl Promoting<'_> {
    /// The window read `bytes` in all.
    pub fn moved(&mut self, bytes: u64) {
        self.bytes = bytes;
    }
}

impl Drop for Promoting<'_> {
    fn drop(&mut self) {
        if let Some((bytes, span)) = self.tier.promotions.end(self.bytes) {
            let costs = &self.tier.metrics.costs;
            costs.record(crate::obs::cost::NVME_READ, bytes, span);
        }
    }
}

/// A spill read in flight into a reserved DRAM slot.
#[derive(Debug)]
pub struct PendingRead {
    done: kvnode_spill::Completion<kvnode_spill::Done<ReadOutcome>>,
    sk: SpillKey,
    len: u64,
    t0: u64,
}

/// The 64-bit id probes name a block by (its router hash).
fn probe_id(sk: &SpillKey) -> u64 {
    sk.digest[0..8]
        .iter()
        .fold(0, |a, b| a << 8 | u64::from(*b))
}

/// The spill key of a block: namespace id, digest, segment.
pub fn spill_key(k: &BlockKey) -> SpillKey {
    SpillKey {
        namespace: k.ns.0,
        digest: k.digest.0,
        segment: k.segment,
    }
}

fn spill_key_of(id: NamespaceId, k: &Key) -> SpillKey {
    SpillKey {
        namespace: id.0,
        digest: k.0.0,
        segment: k.1,
    }
}

impl NvmeTier {
    /// Opens (and recovers) the spill files and attaches the arena for transfers.
    pub fn open(
        settings: &SpillSettings,
        slab_bytes: u64,
        arena: &crate::arena::Arena,
        announcer: Arc<Announcer>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, SpillError> {
        Self::lock(settings, slab_bytes)?.recover(arena, announcer, metrics)
    }

    /// Opens and locks the spill files (what can refuse a start), leaving the rebuild of
    /// their index to [`NvmeOpening::recover`].
    pub fn lock(settings: &SpillSettings, slab_bytes: u64) -> Result<NvmeOpening, SpillError> {
        let smallest = settings.dirs.iter().map(|d| d.size).min().unwrap_or(0);
        let max_block = slab_bytes.min(1 << 30);
        let min_region = (max_block + 3 * 4096).div_ceil(4096) * 4096;
        let region = settings.region_size.unwrap_or_else(|| {
            // A quarter of the smallest file, at least one whole block and its headers,
            // at most 64 MiB unless one block needs more.
            ((smallest / 4) / 4096 * 4096).clamp(min_region, min_region.max(64 << 20))
        });
        #[cfg_attr(
            not(feature = "test-seams"),
            expect(unused_mut, reason = "faults wrap it in test builds")
        )]
        let mut engine = match settings.engine {
            SpillEngine::Uring => IoEngineKind::Uring,
            SpillEngine::Psync => IoEngineKind::Psync,
        };
        #[cfg(feature = "test-seams")]
        if let Some(f) = &settings.debug_fault {
            use kvnode_spill::FaultPlan;
            tracing::warn!(
                ?f,
                "spill fault injection is ON (debug_fault): for tests only"
            );
            engine = IoEngineKind::Faulty {
                inner: Box::new(engine),
                plan: FaultPlan {
                    fail_write: f.fail_write,
                    fail_fsync: f.fail_fsync,
                    fail_read: f.fail_read,
                    ..FaultPlan::default()
                },
            };
        }
        let mut b = SpillConfig::builder()
            .engine(engine)
            .region_size(region)
            .max_block_size(max_block as usize)
            .queue_depth(32);
        for d in &settings.dirs {
            b = b.dir(&d.path, d.size);
        }
        let opening = SpillOpening::lock(b.build()?)?;
        Ok(NvmeOpening {
            opening,
            settings: settings.clone(),
        })
    }
}

/// Spill files opened and locked, not yet recovered ([`NvmeTier::lock`]).
#[derive(Debug)]
pub struct NvmeOpening {
    opening: SpillOpening,
    settings: SpillSettings,
}

impl NvmeOpening {
    /// Rebuilds the spill index (time in proportion to the blocks on disk) and attaches
    /// the arena for transfers.
    pub fn recover(
        self,
        arena: &crate::arena::Arena,
        announcer: Arc<Announcer>,
        metrics: Arc<Metrics>,
    ) -> Result<NvmeTier, SpillError> {
        let settings = self.settings;
        let spill = self.opening.recover()?;
        let r = spill.recovery();
        tracing::info!(
            blocks = r.blocks,
            bytes = r.bytes,
            skipped = r.skipped,
            deleted = r.deleted,
            elapsed_ms = r.elapsed.as_millis() as u64,
            capacity = spill.config().capacity(),
            "spill tier recovered"
        );
        // SAFETY: the arena mapping lives as long as the engine, which owns this tier; a slot
        // under a spill write is leased (never written), a slot under a read is reserved
        // (never read or handed out) until the operation completes.
        // Attached now (plain transfers), registered as fixed buffers once the arena is
        // faulted in ([`NvmeTier::register_buffers_when_populated`]): registering pins every
        // page, and doing it here made start-up wait for the whole arena to be faulted in.
        unsafe { spill.attach_arena(arena.base(), arena.len() as usize)? };
        Ok(NvmeTier {
            spill,
            settings,
            announcer,
            residencies: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            in_flight: AtomicUsize::new(0),
            progress: tokio::sync::Notify::new(),
            metrics,
            quota: quota::NvmeQuota::default(),
            copies: CopyCounters::default(),
            promotions: crate::obs::cost::Overlapped::default(),
        })
    }
}

impl NvmeTier {
    /// Registers the arena as fixed buffers on a background thread once `progress` says the
    /// arena is faulted in (or `stop` is set: then never). Holds only a weak handle while
    /// it waits, so it never keeps the spill files open at shutdown.
    pub fn register_buffers_when_populated(
        self: &Arc<Self>,
        progress: Arc<crate::arena::PinProgress>,
        stop: Arc<std::sync::atomic::AtomicBool>,
    ) {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("kvnode-fixedbuf".into())
            .spawn(move || {
                while !progress.done.load(Relaxed) {
                    if stop.load(Relaxed) {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                if stop.load(Relaxed) || progress.populated.load(Relaxed) == 0 {
                    // Stopping, or population is off: registering would fault the whole
                    // arena in with the IO workers paused.
                    return;
                }
                let Some(t) = weak.upgrade() else { return };
                let t0 = std::time::Instant::now();
                match t.spill.register_attached_arena() {
                    Ok(_) => tracing::debug!(
                        elapsed_ms = t0.elapsed().as_millis() as u64,
                        "arena registered with the spill rings as fixed buffers"
                    ),
                    Err(e) => tracing::warn!(error = %e, "cannot register the arena as fixed buffers; spill IO uses plain reads and writes"),
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the fixed-buffer registration thread");
        }
    }

    fn residencies(&self) -> std::sync::MutexGuard<'_, HashMap<SpillKey, Residency>> {
        self.residencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets blocks the spill tier no longer holds (evicted, corrupt, deleted): announces
    /// their removal. A key written again since (a newer copy is on disk) keeps its
    /// residency. The check and the removal's announcement happen under the map lock that
    /// the demoter takes to announce a store, so a block's NVMe removal and its next NVMe
    /// store are published in the order they happened.
    fn forget(&self, keys: &[SpillKey]) {
        let mut m = self.residencies();
        for k in keys {
            if !self.spill.contains(k) {
                drop(m.remove(k));
                self.quota.uncharge(k);
            }
        }
    }

    /// Whether the NVMe tier holds `k` of namespace `id`.
    pub fn contains(&self, id: NamespaceId, k: &Key) -> bool {
        self.spill.contains(&spill_key_of(id, k))
    }

    /// Deletes one block; returns whether it was held.
    pub fn delete(&self, id: NamespaceId, k: &Key) -> bool {
        let sk = spill_key_of(id, k);
        let held = self.spill.delete(&sk);
        self.forget(&[sk]);
        held
    }

    /// Deletes every block of namespace `id` (or of all), persisted by a clear marker in the
    /// spill files; returns how many were held.
    pub fn clear(&self, id: Option<NamespaceId>) -> u64 {
        let keys = self.spill.clear(id.map(|i| i.0));
        self.forget(&keys);
        keys.len() as u64
    }

    /// Length of the block `k` of namespace `id`, if this tier holds it.
    pub fn block_len(&self, id: NamespaceId, k: &Key) -> Option<u64> {
        self.spill.block_len(&spill_key_of(id, k)).map(|l| l as u64)
    }

    /// Starts reading block `k` of namespace `id` into the arena at `offset` (a slot of at
    /// least `len` bytes rounded up to 4 KiB that the caller holds reserved until the read
    /// is finished with [`NvmeTier::finish_read`]).
    pub fn submit_read(&self, id: NamespaceId, k: &Key, offset: u64, len: u64) -> PendingRead {
        let sk = spill_key_of(id, k);
        let buf = IoBuf::Arena(ArenaSlice {
            offset: offset as usize,
            len: (len.div_ceil(4096) * 4096) as usize,
        });
        crate::probes::spill_submit(crate::probes::SPILL_READ, probe_id(&sk), len);
        PendingRead {
            done: self.spill.read(sk, buf),
            sk,
            len,
            t0: self.metrics.now_ns(),
        }
    }

    /// A promotion window starts; the returned timer, given the window's bytes
    /// ([`Promoting::moved`]) and dropped, feeds the live cost model. Windows in flight
    /// together are measured as one busy period ([`crate::obs::cost::Overlapped`]).
    pub fn promoting(&self) -> Promoting<'_> {
        self.promotions.begin();
        Promoting {
            tier: self,
            bytes: 0,
        }
    }

    /// Waits for a read: `Some(meta)` when the bytes landed whole and verified (with the
    /// router metadata to announce the promoted block with), `None` for a miss.
    pub async fn finish_read(&self, ns: u32, r: PendingRead) -> Option<Option<Arc<RouterMeta>>> {
        let PendingRead { done, sk, len, t0 } = r;
        let result = done.await.result;
        let lat = self.metrics.now_ns().saturating_sub(t0);
        let status = if result.is_ok() {
            0
        } else {
            -i64::from(libc::EIO)
        };
        crate::probes::spill_complete(crate::probes::SPILL_READ, probe_id(&sk), len, status, lat);
        match result {
            Ok(ReadOutcome::Hit { len: got }) if got as u64 == len => {
                self.metrics.record_tier("nvme read", lat, len);
                crate::probes::promote(ns, len, lat);
                self.counters.hits.fetch_add(1, Relaxed);
                Some(self.residencies().get(&sk).map(|r| Arc::clone(r.meta())))
            }
            Ok(ReadOutcome::Miss(why)) => {
                self.counters.misses.fetch_add(1, Relaxed);
                if why == MissReason::Corrupt {
                    self.counters.corrupt.fetch_add(1, Relaxed);
                    tracing::warn!(key = ?sk, "spilled block failed verification: served as a miss");
                }
                if !self.spill.contains(&sk) {
                    self.forget(&[sk]);
                }
                None
            }
            Ok(_) => None,
            Err(e) => {
                self.counters.errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "promotion read failed: served as a miss");
                None
            }
        }
    }

    /// How long a request waits for DRAM room (`spill.room_wait_ms`).
    pub fn room_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.settings.room_wait_ms)
    }

    /// Counts blocks promoted into DRAM.
    pub fn count_promotions(&self, n: u64) {
        self.counters.promotions.fetch_add(n, Relaxed);
    }

    /// The NVMe tier's row of `kvnode stats`.
    pub fn stats(&self) -> TierStats {
        let s = self.spill.stats();
        let c = &self.counters;
        TierStats {
            tier: "nvme".into(),
            capacity_bytes: s.capacity,
            blocks: s.blocks,
            bytes: s.bytes,
            slot_bytes: s.bytes,
            hits: c.hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            inserts: s.writes,
            evictions: c.evictions.load(Relaxed),
            promotions: c.promotions.load(Relaxed),
            errors: s.errors + c.errors.load(Relaxed) + c.queue_full.load(Relaxed),
            queue_depth: s.queue_depth,
            oldest_queued_ms: s.oldest_queued.map_or(0, |d| d.as_millis() as u64),
            in_flight: self.in_flight.load(Relaxed) as u64,
            poisoned: s.poisoned,
            corrupt: s.checksum_failures,
            copied_down: self.copies.copied.load(Relaxed),
            lag_exceeded: self.copies.lag_exceeded.load(Relaxed),
            delete_markers: s.marks_written,
            recovered_deleted: s.recovery_deleted,
            ..TierStats::default()
        }
    }

    /// The medium this tier announces.
    pub const MEDIUM: Medium = Medium::Disk;
}
