//! The client protocol server: listener, connections, request handlers.
//!
//! Each connection owns its leases and reservations; when it ends, for whatever reason,
//! they are released, so a crashed client leaks nothing.

mod conn;
mod handler;
mod hinted;
pub mod io;
mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use kvnode_proto::stats::StatsReport;

use crate::arena::{Arena, ArenaError, PinOptions};
use crate::config::EngineConfig;
use crate::peer::{PeerError, Peers};
use crate::tier::{DramTier, TierConfig};

pub use server::{ServeError, bind, serve};

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The DRAM arena.
    #[error("creating the DRAM arena: {0}")]
    Arena(#[from] ArenaError),
    /// The peer service.
    #[error("starting the peer service: {0}")]
    Peer(#[from] PeerError),
}

/// Everything a connection needs: config, arena, tier, counters.
#[derive(Debug)]
pub struct Engine {
    /// Configuration in force.
    pub config: EngineConfig,
    /// The DRAM arena.
    pub arena: Arc<Arena>,
    /// The DRAM tier.
    pub tier: DramTier,
    /// Peer pulls and operations.
    pub peers: Peers,
    clients: AtomicU32,
    next_conn: AtomicU64,
    started: Instant,
    stop_pinning: Arc<AtomicBool>,
}

impl Engine {
    /// Creates the arena, tier and peer service and starts background pinning. Returns
    /// immediately.
    pub fn start(config: EngineConfig) -> Result<Arc<Self>, StartError> {
        let peers = Peers::new(&config.peer)?;
        let arena = Arc::new(Arena::create(config.dram, config.hugetlb)?);
        let tier = DramTier::new(&TierConfig {
            capacity: arena.len(),
            slab_bytes: config.slab_bytes(),
            policy: config.eviction,
        });
        let stop_pinning = Arc::new(AtomicBool::new(false));
        arena.start_pinning(
            PinOptions {
                pin: config.pin,
                populate: config.populate,
                chunk: 64 << 20,
            },
            Arc::clone(&stop_pinning),
        );
        Ok(Arc::new(Self {
            config,
            arena,
            tier,
            peers,
            clients: AtomicU32::new(0),
            next_conn: AtomicU64::new(1),
            started: Instant::now(),
            stop_pinning,
        }))
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
            tiers: vec![dram],
            pools: snap.pools,
            namespaces: snap.namespaces,
        }
    }
}
