//! The NVMe spill tier under DRAM: opening it, promotion on `get`, `exists`/`delete`/`clear` across tiers, stats.
//!
//! ```text
//!  put ──> DRAM tier ── free < low watermark ──> demoter (tokio task, demoter.rs)
//!            ^   |        picks LRU victims; each keeps its slot (one lease) while
//!            |   |        spill.try_write(key, Arena{offset,len}) runs on the IO thread
//!  promote   |   v        then leaves DRAM (DISK store announced before the DRAM remove)
//!  (get miss)|  SpillTier (kvnode-spill: io_uring O_DIRECT, fixed buffers = the arena)
//!            └── spill.read(key, Arena{reserved slot}) ── commit as a DRAM block
//! ```
//!
//! Spill keys use the 128-bit [`kvnode_proto::NamespaceId`], never the per-process handle,
//! so after a restart the rebuilt spill index serves a namespace as soon as a client
//! registers it again. The DRAM tier never imports the spill crate; this module joins them.

pub mod config;
mod demoter;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvnode_events::Medium;
use kvnode_proto::stats::TierStats;
use kvnode_proto::{BlockKey, Key, NamespaceId};
use kvnode_spill::{
    ArenaSlice, FaultPlan, IoBuf, IoEngineKind, MissReason, ReadOutcome, SpillConfig, SpillError,
    SpillKey, SpillTier,
};

use crate::api::Engine;
use crate::residency::{Announcer, Residency, RouterMeta};
use crate::tier::{LeasedBlock, Reservation, TierError};
use config::{SpillEngine, SpillSettings};

pub use demoter::spawn_demoter;

/// Connection id of reservations the engine itself makes (promotions).
const ENGINE_CONN: u64 = 0;

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
pub struct Tiering {
    spill: SpillTier,
    settings: SpillSettings,
    announcer: Arc<Announcer>,
    /// DISK residencies of blocks with router metadata (lock order: DRAM tier, then this).
    nvme: Mutex<HashMap<SpillKey, Residency>>,
    counters: Counters,
    in_flight: AtomicUsize,
    progress: tokio::sync::Notify,
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

impl Tiering {
    /// Opens (and recovers) the spill files and registers the arena as fixed buffers.
    pub fn open(
        settings: &SpillSettings,
        slab_bytes: u64,
        arena: &crate::arena::Arena,
        announcer: Arc<Announcer>,
    ) -> Result<Self, SpillError> {
        let smallest = settings.dirs.iter().map(|d| d.size).min().unwrap_or(0);
        let max_block = slab_bytes.min(1 << 30);
        let min_region = (max_block + 3 * 4096).div_ceil(4096) * 4096;
        let region = settings
            .region_size
            .unwrap_or_else(|| ((smallest / 4) / 4096 * 4096).clamp(min_region, 64 << 20));
        let mut engine = match settings.engine {
            SpillEngine::Uring => IoEngineKind::Uring,
            SpillEngine::Psync => IoEngineKind::Psync,
        };
        if let Some(f) = &settings.debug_fault {
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
        let spill = SpillTier::open(b.build()?)?;
        let r = spill.recovery();
        tracing::info!(
            blocks = r.blocks,
            bytes = r.bytes,
            skipped = r.skipped,
            elapsed_ms = r.elapsed.as_millis() as u64,
            capacity = spill.config().capacity(),
            "spill tier recovered"
        );
        // SAFETY: the arena mapping lives as long as the engine, which owns this tier; a slot
        // under a spill write is leased (never written), a slot under a read is reserved
        // (never read or handed out) until the operation completes.
        unsafe { spill.register_arena(arena.base(), arena.len() as usize)? };
        Ok(Self {
            spill,
            settings: settings.clone(),
            announcer,
            nvme: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            in_flight: AtomicUsize::new(0),
            progress: tokio::sync::Notify::new(),
        })
    }

    fn nvme(&self) -> std::sync::MutexGuard<'_, HashMap<SpillKey, Residency>> {
        self.nvme
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets blocks the spill tier no longer holds (evicted, corrupt, deleted): announces
    /// their removal. A key written again since (a newer copy is on disk) keeps its
    /// residency. The check and the removal's announcement happen under the map lock that
    /// the demoter takes to announce a store, so a block's NVMe removal and its next NVMe
    /// store are published in the order they happened.
    fn forget(&self, keys: &[SpillKey]) {
        let mut m = self.nvme();
        for k in keys {
            if !self.spill.contains(k) {
                drop(m.remove(k));
            }
        }
    }

    /// Leading keys present in DRAM or on NVMe.
    pub fn exists(&self, engine: &Engine, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        let id = engine.tier.namespace_id(ns)?;
        let dram = engine.tier.contains(ns, keys)?;
        let n = keys
            .iter()
            .zip(dram)
            .take_while(|(k, d)| *d || self.spill.contains(&spill_key_of(id, k)))
            .count();
        Ok(n as u32)
    }

    /// Deletes keys from both tiers; returns how many were present in either.
    pub fn delete(&self, engine: &Engine, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        let id = engine.tier.namespace_id(ns)?;
        let dram = engine.tier.contains(ns, keys)?;
        engine.tier.delete(ns, keys)?;
        let mut n = 0;
        for (k, d) in keys.iter().zip(dram) {
            let sk = spill_key_of(id, k);
            let on_disk = self.spill.delete(&sk);
            self.forget(&[sk]);
            n += u32::from(d || on_disk);
        }
        Ok(n)
    }

    /// Clears one namespace (or all) in both tiers; returns blocks removed from DRAM plus
    /// blocks removed from NVMe that were not also in DRAM.
    pub fn clear(&self, engine: &Engine, ns: Option<u32>) -> Result<u64, TierError> {
        let id = ns.map(|h| engine.tier.namespace_id(h)).transpose()?;
        if id.is_none() {
            self.announcer.clear_all();
        }
        let n = engine.tier.clear(ns)?;
        let keys: Vec<SpillKey> = self
            .spill
            .keys()
            .into_iter()
            .filter(|k| id.is_none_or(|i| k.namespace == i.0))
            .collect();
        let mut extra = 0;
        for k in &keys {
            extra += u64::from(self.spill.delete(k));
        }
        self.forget(&keys);
        Ok(n.max(extra))
    }

    /// For every DRAM miss in `leased` that the spill tier holds, reads the block into a
    /// fresh DRAM slot, commits it (announced as a DRAM store) and leases it. Runs as its
    /// own task so a dropped request cannot strand a slot under an in-flight read.
    pub async fn promote_misses(
        self: &Arc<Self>,
        engine: &Arc<Engine>,
        ns: u32,
        keys: &[Key],
        leased: &mut [Option<LeasedBlock>],
    ) {
        let Ok(id) = engine.tier.namespace_id(ns) else {
            return;
        };
        let want: Vec<(usize, Key, SpillKey, u64)> = keys
            .iter()
            .enumerate()
            .filter(|(i, _)| leased[*i].is_none())
            .filter_map(|(i, k)| {
                let sk = spill_key_of(id, k);
                self.spill.block_len(&sk).map(|l| (i, *k, sk, l as u64))
            })
            .collect();
        if want.is_empty() {
            return;
        }
        let (t, e) = (Arc::clone(self), Arc::clone(engine));
        let task = tokio::spawn(async move { t.promote(&e, ns, want).await });
        let Ok(got) = task.await else { return };
        for (i, l) in got {
            leased[i] = Some(l);
        }
    }

    async fn promote(
        &self,
        engine: &Engine,
        ns: u32,
        want: Vec<(usize, Key, SpillKey, u64)>,
    ) -> Vec<(usize, LeasedBlock)> {
        let ks: Vec<Key> = want.iter().map(|w| w.1).collect();
        let lens: Vec<u64> = want.iter().map(|w| w.3).collect();
        let Ok(reserved) = engine.tier.reserve(ENGINE_CONN, ns, &ks, &lens) else {
            return Vec::new();
        };
        let mut reads = Vec::new();
        for (w, r) in want.iter().zip(reserved) {
            let Ok(res) = r else { continue };
            let buf = IoBuf::Arena(ArenaSlice {
                offset: res.offset as usize,
                len: (res.len.div_ceil(4096) * 4096) as usize,
            });
            crate::probes::spill_submit(
                crate::probes::SPILL_READ,
                w.2.digest[0..8]
                    .iter()
                    .fold(0, |a, b| a << 8 | u64::from(*b)),
                res.len,
            );
            reads.push((w.0, w.1, w.2, res, self.spill.read(w.2, buf)));
        }
        let t0 = engine.metrics.now_ns();
        let mut commit: Vec<(Reservation, Option<Arc<RouterMeta>>)> = Vec::new();
        let mut abort = Vec::new();
        let mut idx = Vec::new();
        for (i, k, sk, res, done) in reads {
            let result = done.await.result;
            let lat = engine.metrics.now_ns().saturating_sub(t0);
            let id = sk.digest[0..8]
                .iter()
                .fold(0, |a, b| a << 8 | u64::from(*b));
            let status = if result.is_ok() {
                0
            } else {
                -i64::from(libc::EIO)
            };
            crate::probes::spill_complete(crate::probes::SPILL_READ, id, res.len, status, lat);
            match result {
                Ok(ReadOutcome::Hit { len }) if len as u64 == res.len => {
                    engine.metrics.record_tier("nvme read", lat, res.len);
                    crate::probes::promote(ns, res.len, lat);
                    self.counters.hits.fetch_add(1, Relaxed);
                    let meta = self.nvme().get(&sk).map(|r| Arc::clone(r.meta()));
                    commit.push((res, meta));
                    idx.push((i, k));
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
                    abort.push(res);
                }
                Ok(_) => abort.push(res),
                Err(e) => {
                    self.counters.errors.fetch_add(1, Relaxed);
                    tracing::warn!(error = %e, "promotion read failed: served as a miss");
                    abort.push(res);
                }
            }
        }
        engine.tier.abort(ENGINE_CONN, &abort);
        engine.tier.commit_with(ENGINE_CONN, &commit, true);
        self.counters
            .promotions
            .fetch_add(commit.len() as u64, Relaxed);
        engine.tier.count_promotions(commit.len() as u64);
        let ks: Vec<Key> = idx.iter().map(|x| x.1).collect();
        let Ok(leased) = engine.tier.lease(ns, &ks) else {
            return Vec::new();
        };
        idx.iter()
            .zip(leased)
            .filter_map(|((i, _), l)| l.map(|l| (*i, l)))
            .collect()
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
            ..TierStats::default()
        }
    }

    /// The medium this tier announces.
    pub const MEDIUM: Medium = Medium::Disk;
}
