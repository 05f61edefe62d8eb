//! The client protocol server: listener, connections, request handlers.
//!
//! Each connection owns its leases and reservations; when it ends, for whatever reason,
//! they are released, so a crashed client leaks nothing.

mod conn;
mod gpu;
mod handler;
mod hinted;
pub mod io;
mod meta;
mod region;
mod region_copy;
mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use kvnode_proto::stats::StatsReport;

use crate::arena::{Arena, ArenaError, PinOptions};
use crate::config::EngineConfig;
use crate::obs::Metrics;
use crate::peer::{PeerError, Peers};
use crate::residency::Announcer;
use crate::tier::{DramTier, TierConfig, TierError};
use crate::tiering::Tiering;

pub use server::{ServeError, bind, serve};

/// A stable 64-bit name hash (FNV-1a), used to number peers in probes.
pub fn hash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Failure to start the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The DRAM arena could not be created.
    #[error("creating the DRAM arena: {0}")]
    Arena(#[from] ArenaError),
    /// The spill tier could not be opened.
    #[error("opening the spill tier: {0}")]
    Spill(#[from] kvnode_spill::SpillError),
    /// The peer service.
    #[error("starting the peer service: {0}")]
    Peer(#[from] PeerError),
}

/// Everything a connection needs: config, arena, tier, counters.
#[derive(Debug)]
pub struct Engine {
    /// Configuration in force.
    pub config: EngineConfig,
    /// GPU path (declared before the arena: its registration is dropped first).
    pub gpu: kvnode_gpu::GpuHub,
    /// The DRAM arena.
    pub arena: Arc<Arena>,
    /// The DRAM tier.
    pub tier: DramTier,
    /// The NVMe spill tier, when configured.
    pub tiering: Option<Arc<Tiering>>,
    /// Publishes residency events (or nothing, when events are off).
    pub announcer: Arc<Announcer>,
    /// Histograms, counters and the stall watchdog's view of connections.
    pub metrics: Metrics,
    /// Peer pulls and operations.
    pub peers: Peers,
    /// Client regions attached by copy mode, and absorbed faults.
    pub regions: region_copy::RegionCounters,
    clients: AtomicU32,
    next_conn: AtomicU64,
    started: Instant,
    stop_pinning: Arc<AtomicBool>,
}

impl Engine {
    /// Creates the arena and tier and starts background pinning. Returns immediately.
    pub fn start(config: EngineConfig) -> Result<Arc<Self>, StartError> {
        Self::start_with(config, Announcer::new(None))
    }

    /// Like [`Engine::start`], announcing residencies through `announcer`, and opening
    /// (recovering) the spill tier when one is configured. Call
    /// [`Engine::spawn_background`] from inside a tokio runtime afterwards.
    pub fn start_with(
        config: EngineConfig,
        announcer: Arc<Announcer>,
    ) -> Result<Arc<Self>, StartError> {
        let peers = Peers::new(&config.peer)?;
        let arena = Arc::new(Arena::create(config.dram, config.hugetlb)?);
        let tier = DramTier::with_announcer(
            &TierConfig {
                capacity: arena.len(),
                slab_bytes: config.slab_bytes(),
                policy: config.eviction,
            },
            Arc::clone(&announcer),
        );
        let tiering = if config.spill.dirs.is_empty() {
            None
        } else {
            tier.set_has_lower(true);
            Some(Arc::new(Tiering::open(
                &config.spill,
                config.slab_bytes(),
                &arena,
                Arc::clone(&announcer),
            )?))
        };
        let stop_pinning = Arc::new(AtomicBool::new(false));
        arena.start_pinning(
            PinOptions {
                pin: config.pin,
                populate: config.populate,
                chunk: 64 << 20,
            },
            Arc::clone(&stop_pinning),
        );
        let gpu = kvnode_gpu::GpuHub::cuda(kvnode_gpu::WorkerConfig::default());
        gpu.start_registration(
            arena.base(),
            arena.len(),
            kvnode_gpu::register::piece_for_slab(config.slab_bytes()),
            Arc::clone(&stop_pinning),
            Arc::clone(&arena) as Arc<dyn Send + Sync>,
        );
        Ok(Arc::new(Self {
            config,
            gpu,
            arena,
            tier,
            tiering,
            announcer,
            metrics: Metrics::default(),
            peers,
            regions: region_copy::RegionCounters::default(),
            clients: AtomicU32::new(0),
            next_conn: AtomicU64::new(1),
            started: Instant::now(),
            stop_pinning,
        }))
    }

    /// Starts the demoter (with a spill tier); needs a tokio runtime.
    pub fn spawn_background(
        self: &Arc<Self>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let t = self.tiering.as_ref()?;
        Some(crate::tiering::spawn_demoter(
            Arc::clone(t),
            Arc::clone(self),
            stop,
        ))
    }

    /// Leading keys present in any tier.
    pub fn exists(&self, ns: u32, keys: &[kvnode_proto::Key]) -> Result<u32, TierError> {
        match &self.tiering {
            Some(t) => t.exists(self, ns, keys),
            None => self.tier.exists(ns, keys),
        }
    }

    /// Removes keys from every tier; returns how many were present.
    pub fn delete(&self, ns: u32, keys: &[kvnode_proto::Key]) -> Result<u32, TierError> {
        match &self.tiering {
            Some(t) => t.delete(self, ns, keys),
            None => self.tier.delete(ns, keys),
        }
    }

    /// Clears one namespace, or everything (announced as `AllBlocksCleared`), in every tier.
    pub fn clear(&self, ns: Option<u32>) -> Result<u64, TierError> {
        if let Some(t) = &self.tiering {
            return t.clear(self, ns);
        }
        if ns.is_none() {
            self.announcer.clear_all();
        }
        self.tier.clear(ns)
    }

    /// Stops background pinning (at shutdown).
    pub fn stop_background(&self) {
        self.stop_pinning.store(true, Ordering::Relaxed);
    }

    /// Connected clients.
    pub fn clients(&self) -> u32 {
        self.clients.load(Ordering::Relaxed)
    }

    /// The full statistics report.
    pub fn stats(&self) -> StatsReport {
        let snap = self.tier.snapshot();
        let mut dram = snap.tier;
        let p = self.arena.progress();
        dram.pinned_bytes = p.pinned.load(Ordering::Relaxed);
        dram.populated_bytes = p.populated.load(Ordering::Relaxed);
        dram.pin_refused = p.refused.load(Ordering::Relaxed);
        StatsReport {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            clients: self.clients(),
            tiers: std::iter::once(dram)
                .chain(self.tiering.as_ref().map(|t| t.stats()))
                .collect(),
            pools: snap.pools,
            namespaces: snap.namespaces,
            gpu: self.gpu.stats(),
            regions: self.regions.report(),
        }
    }
}
