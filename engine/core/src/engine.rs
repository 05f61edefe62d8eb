//! The engine: wires the store, the peer service, the GPU path and the metrics together.
//!
//! Nothing below this module imports it: the client API takes an `Engine`, the peer
//! service and the tiers take the [`Store`] (or narrower pieces), metrics are rendered
//! from a stats report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use kvnode_proto::stats::StatsReport;

use crate::arena::{Arena, ArenaError, PinOptions};
use crate::config::EngineConfig;
use crate::dram::{DramTier, TierConfig};
use crate::nvme::NvmeTier;
use crate::obs::{Metrics, RegionCounters};
use crate::peer::{PeerError, Peers};
use crate::residency::Announcer;
use crate::store::Store;
use crate::tenant::Tenants;

/// Arena bytes populated and pinned per call. `mlock` and `MADV_POPULATE_WRITE` hold the
/// process's mmap lock while they fault pages in, and every thread that maps memory (a new
/// thread's stack, a growing allocator arena) waits behind it. On a freshly booted VM a
/// 64 MiB chunk held it for 200-300 ms and the first answer waited that long; a 2 MiB chunk
/// (one huge page) holds it for milliseconds.
const PIN_CHUNK: u64 = 2 << 20;

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
    /// A handed-over DRAM image does not fit this configuration.
    #[error("taking over the DRAM tier: {0}")]
    Image(#[from] crate::dram::image::ImageError),
}

/// What a takeover hands to the new engine: the old daemon's arena memfd and the image of
/// its DRAM index ([`crate::dram::image`]).
#[derive(Debug)]
pub struct Handover {
    /// The arena memfd.
    pub arena: std::fs::File,
    /// The DRAM tier's image.
    pub image: Vec<u8>,
    /// The seq at which this daemon continues the predecessor's KV event stream (`None`:
    /// it starts a new one, and announces every block it took over).
    pub events_seq: Option<u64>,
    /// The blocks the predecessor announced on NVMe, with their router metadata (adopted
    /// when the stream continues).
    pub nvme_announced: Vec<(kvnode_proto::BlockKey, crate::residency::RouterMeta)>,
}

impl Handover {
    /// The NVMe announcements to adopt, when the stream continues (taken out).
    fn take_nvme_announced(
        &mut self,
    ) -> Option<Vec<(kvnode_proto::BlockKey, crate::residency::RouterMeta)>> {
        self.events_seq?;
        Some(std::mem::take(&mut self.nvme_announced))
    }
}

/// One daemon's machinery.
#[derive(Debug)]
pub struct Engine {
    /// Configuration in force.
    pub config: EngineConfig,
    /// GPU path (declared before the store: its registration of the arena is dropped first).
    pub gpu: kvnode_gpu::GpuHub,
    /// The tiers and the lookup order.
    pub store: Arc<Store>,
    /// Histograms, counters and the stall watchdog's view of connections.
    pub metrics: Arc<Metrics>,
    /// Peer pulls and operations.
    pub peers: Arc<Peers>,
    /// Client regions attached by copy mode, and absorbed faults.
    pub regions: RegionCounters,
    clients: AtomicU32,
    next_conn: AtomicU64,
    /// The router entry's counters (`stats.router`).
    pub router: crate::obs::RouterCounters,
    started: Instant,
    stop_pinning: Arc<AtomicBool>,
}

/// Adopts the NVMe blocks a predecessor announced on the event stream this daemon continues;
/// retracts (announces the removal of) those the spill tier does not hold.
fn adopt_nvme(
    nvme: Option<&NvmeTier>,
    announcer: &Announcer,
    list: Vec<(kvnode_proto::BlockKey, crate::residency::RouterMeta)>,
) {
    let mut gone = Vec::new();
    {
        let _adopting = announcer.adopting();
        for (key, meta) in list {
            let meta = Arc::new(meta);
            if !nvme.is_some_and(|n| n.adopt_announced(&key, &meta)) {
                gone.push(meta);
            }
        }
    }
    for meta in &gone {
        announcer.retract(kvnode_events::Medium::Disk, meta);
    }
    if !gone.is_empty() {
        tracing::info!(
            blocks = gone.len(),
            "NVMe blocks the previous daemon announced are not in the spill tier: their removal announced"
        );
    }
}

/// The GPU hub: CUDA copy threads; in test builds with `KVNODE_TEST_FAKE_GPU` set, the
/// file-backed fake device instead (a test seam: never compiled into a release daemon).
fn gpu_hub() -> kvnode_gpu::GpuHub {
    #[cfg(feature = "test-seams")]
    if let Ok(v) = std::env::var(kvnode_gpu::fake::FAKE_GPU_ENV) {
        let us = v.trim().parse::<u64>().unwrap_or(0);
        tracing::warn!(
            fence_delay_us = us,
            "fake GPU is ON ({}): IPC handles name files; for tests only",
            kvnode_gpu::fake::FAKE_GPU_ENV
        );
        return kvnode_gpu::fake::file_hub(
            std::time::Duration::from_micros(us),
            kvnode_gpu::WorkerConfig::default(),
        );
    }
    kvnode_gpu::GpuHub::cuda(kvnode_gpu::WorkerConfig::default())
}

impl Engine {
    /// Creates the arena and tiers and starts background pinning. Returns immediately.
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
        Self::start_from(config, announcer, None)
    }

    /// Like [`Engine::start_with`]; with `from`, the arena and DRAM blocks are the ones a
    /// previous daemon handed over (nothing is copied), checked against this configuration.
    pub fn start_from(
        config: EngineConfig,
        announcer: Arc<Announcer>,
        from: Option<Handover>,
    ) -> Result<Arc<Self>, StartError> {
        Self::start_full(config, announcer, from, gpu_hub())
    }

    /// Like [`Engine::start_with`], with a GPU hub made by the caller (tests: the fake GPU).
    #[cfg(feature = "test-seams")]
    pub fn start_with_gpu(
        config: EngineConfig,
        gpu: kvnode_gpu::GpuHub,
    ) -> Result<Arc<Self>, StartError> {
        Self::start_full(config, Announcer::new(None), None, gpu)
    }

    fn start_full(
        config: EngineConfig,
        announcer: Arc<Announcer>,
        from: Option<Handover>,
        gpu: kvnode_gpu::GpuHub,
    ) -> Result<Arc<Self>, StartError> {
        let metrics = Arc::new(Metrics::default());
        let tier = |capacity| TierConfig {
            capacity,
            slab_bytes: config.slab_bytes(),
            policy: config.eviction,
        };
        let mut from = from;
        let nvme_announced = from.as_mut().and_then(Handover::take_nvme_announced);
        let (arena, dram) = match from {
            None => {
                let arena = Arena::create(config.dram, config.hugetlb)?;
                let dram = DramTier::with_announcer(&tier(arena.len()), Arc::clone(&announcer));
                (arena, dram)
            }
            Some(h) => {
                let len = if config.hugetlb {
                    config.dram.div_ceil(2 << 20) * (2 << 20)
                } else {
                    config.dram
                };
                let arena = Arena::adopt(h.arena, len)?;
                // On a continued stream the predecessor announced these blocks: adopt them.
                let adopting = h.events_seq.map(|_| announcer.adopting());
                let dram = DramTier::restore(&tier(arena.len()), Arc::clone(&announcer), &h.image)?;
                drop(adopting);
                (arena, dram)
            }
        };
        let arena = Arc::new(arena);
        let dram = Arc::new(dram);
        let nvme = if config.spill.dirs.is_empty() {
            None
        } else {
            Some(Arc::new(NvmeTier::open(
                &config.spill,
                config.slab_bytes(),
                &arena,
                Arc::clone(&announcer),
                Arc::clone(&metrics),
            )?))
        };
        let tenants = Arc::new(Tenants::new(
            &config.tenants.with_default_quota(config.dram),
        ));
        if let Some(n) = &nvme {
            n.set_tenants(Arc::clone(&tenants));
        }
        if let Some(list) = nvme_announced {
            adopt_nvme(nvme.as_deref(), &announcer, list);
        }
        let store = Store::with_tenants(Arc::clone(&arena), dram, nvme, announcer, tenants);
        let peers = Arc::new(Peers::new(
            &config.peer,
            Arc::clone(&store),
            Arc::clone(&metrics),
        )?);
        let stop_pinning = Arc::new(AtomicBool::new(false));
        arena.start_pinning(
            PinOptions {
                pin: config.pin,
                populate: config.populate,
                chunk: PIN_CHUNK,
            },
            Arc::clone(&stop_pinning),
        );
        if let Some(t) = store.nvme() {
            t.register_buffers_when_populated(
                Arc::clone(arena.progress()),
                Arc::clone(&stop_pinning),
            );
        }
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
            store,
            metrics,
            peers,
            regions: RegionCounters::default(),
            clients: AtomicU32::new(0),
            next_conn: AtomicU64::new(1),
            router: crate::obs::RouterCounters::default(),
            started: Instant::now(),
            stop_pinning,
        }))
    }

    /// Starts the demoter (with a spill tier); needs a tokio runtime.
    pub fn spawn_background(
        &self,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        crate::store::spawn_demoter(Arc::clone(&self.store), stop)
    }

    /// Runs the stall watchdog until `stop`; needs a tokio runtime.
    pub async fn watchdog(self: Arc<Self>, stop: tokio::sync::watch::Receiver<bool>) {
        let limits = crate::obs::watch::Limits {
            op_deadline_s: self.config.op_deadline_s,
            lease_age_limit_s: self.config.lease_age_limit_s,
        };
        crate::obs::watchdog(
            Arc::clone(&self.metrics),
            limits,
            Arc::clone(self.store.arena().progress()),
            stop,
        )
        .await;
    }

    /// What a successor needs to take the DRAM tier over: a descriptor of the arena memfd
    /// and the image of the index. Call only once no request, demotion or copy can run.
    pub fn handover(&self) -> Result<Handover, String> {
        let image = self.store.dram().image().map_err(|e| e.to_string())?;
        let fd = self
            .store
            .arena()
            .fd()
            .try_clone_to_owned()
            .map_err(|e| format!("duplicating the arena descriptor: {e}"))?;
        Ok(Handover {
            arena: std::fs::File::from(fd),
            image,
            events_seq: None,
            nvme_announced: Vec::new(),
        })
    }

    /// Stops background pinning (at shutdown).
    pub fn stop_background(&self) {
        self.stop_pinning.store(true, Ordering::Relaxed);
    }

    /// The tenant map and which namespace is whose.
    pub fn tenants(&self) -> &Arc<Tenants> {
        self.store.tenants()
    }

    /// Connected clients.
    pub fn clients(&self) -> u32 {
        self.clients.load(Ordering::Relaxed)
    }

    /// Counts a client connection in (returns its id).
    pub fn client_connected(&self) -> u64 {
        self.clients.fetch_add(1, Ordering::Relaxed);
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// A connection id for work the daemon does on no client's behalf (the router entry's
    /// pulls): never a client's.
    pub fn internal_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts a client connection out.
    pub fn client_disconnected(&self) {
        self.clients.fetch_sub(1, Ordering::Relaxed);
    }

    /// The full statistics report.
    pub fn stats(&self) -> StatsReport {
        let (snap, nvme) = self.store.snapshot();
        let mut dram = snap.tier;
        let p = self.store.arena().progress();
        dram.pinned_bytes = p.pinned.load(Ordering::Relaxed);
        dram.populated_bytes = p.populated.load(Ordering::Relaxed);
        dram.pin_refused = p.refused.load(Ordering::Relaxed);
        let bytes: std::collections::HashMap<u32, u64> =
            snap.namespaces.iter().map(|n| (n.ns, n.bytes)).collect();
        let tenants = self
            .store
            .tenants()
            .report(|h| bytes.get(&h).copied().unwrap_or(0));
        StatsReport {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            clients: self.clients(),
            tiers: std::iter::once(dram).chain(nvme).collect(),
            pools: snap.pools,
            namespaces: snap.namespaces,
            gpu: self.gpu.stats(),
            regions: self.regions.report(),
            cluster: self.cluster_summary(),
            tenants,
            refused: self.metrics.refused(),
            peer: self.peers.peer_stats(),
            peer_connections: self.peers.config().connections,
            peer_connections_basis: self.peers.connections_basis().to_owned(),
            events: self.store.announcer().report(),
            router: self.router_stats(),
            costs: self.metrics.costs.report(),
            plans: self.metrics.plans.report(),
        }
    }

    fn router_stats(&self) -> kvnode_proto::stats::RouterStats {
        let c = &self.peers.counters;
        kvnode_proto::stats::RouterStats {
            resolve_asked: c.resolve_asked.load(Ordering::Relaxed),
            resolve_found: c.resolve_found.load(Ordering::Relaxed),
            ..self.router.report()
        }
    }

    /// Cluster health for `stats` and `/metrics`, when the daemon runs with a membership.
    fn cluster_summary(&self) -> Option<kvnode_proto::cluster::ClusterSummary> {
        let m = self.peers.membership()?;
        let mut s = m.summary();
        s.refused_hints = self.peers.counters.refused_members.load(Ordering::Relaxed);
        Some(s)
    }

    /// The `cluster` op's answer: `None` when the daemon runs without a membership.
    pub fn cluster_report(&self) -> Option<kvnode_proto::cluster::ClusterReport> {
        let m = self.peers.membership()?;
        let mut r = m.report();
        r.summary.refused_hints = self.peers.counters.refused_members.load(Ordering::Relaxed);
        Some(r)
    }

    /// The Prometheus exporter (`--metrics`): reads [`Engine::stats`] and the metrics on each
    /// render. It holds the engine: drop it before the engine's last handle.
    pub fn exporter(self: &Arc<Self>) -> crate::obs::prom::Exporter {
        let engine = Arc::clone(self);
        crate::obs::prom::Exporter::new(move || engine.stats(), Arc::clone(&self.metrics))
    }
}
