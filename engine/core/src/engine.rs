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
    /// A thread of the engine could not be started.
    #[error("starting {0}: {1}")]
    Thread(&'static str, std::io::Error),
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
    /// The DRAM tier already rebuilt from the image (a live takeover: built while the
    /// predecessor served, its delta applied); `image` is then not read again.
    pub dram: Option<DramTier>,
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

/// Test builds: milliseconds the spill recovery thread waits before it starts, so a test
/// can act while the tier recovers (a test seam: never compiled into a release daemon).
#[cfg(feature = "test-seams")]
pub const SPILL_RECOVERY_DELAY_ENV: &str = "KVNODE_TEST_SPILL_RECOVERY_DELAY_MS";

/// Rebuilds the spill index on a thread of its own and attaches the NVMe tier to `store`
/// when it is ready (store/lower.rs); a failed rebuild leaves DRAM serving alone.
fn recover_in_background(
    opening: crate::nvme::NvmeOpening,
    store: &Arc<Store>,
    metrics: &Arc<Metrics>,
    stop_pinning: &Arc<AtomicBool>,
) -> Result<(), StartError> {
    let owner = store;
    let (store, metrics, stop) = (
        Arc::clone(store),
        Arc::clone(metrics),
        Arc::clone(stop_pinning),
    );
    let h = std::thread::Builder::new()
        .name("kvnode-spill-open".into())
        .spawn(move || {
            let arena = Arc::clone(store.arena());
            let announcer = Arc::clone(store.announcer());
            #[cfg(feature = "test-seams")]
            if let Some(ms) = std::env::var(SPILL_RECOVERY_DELAY_ENV)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
            {
                tracing::warn!(ms, "{SPILL_RECOVERY_DELAY_ENV} is set: the spill recovery waits (a test seam)");
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            match opening.recover(&arena, announcer, metrics) {
                Ok(t) => {
                    let t = Arc::new(t);
                    t.set_tenants(Arc::clone(store.tenants()));
                    t.register_buffers_when_populated(Arc::clone(arena.progress()), stop);
                    store.attach_nvme(t);
                }
                Err(e) => {
                    tracing::error!(error = %e, "spill tier recovery failed: serving from DRAM only until a restart");
                    store.nvme_failed();
                }
            }
        })
        .map_err(|e| StartError::Thread("the spill recovery thread", e))?;
    owner.set_nvme_opener(h);
    Ok(())
}

/// Adopts the NVMe blocks a predecessor announced on the event stream this daemon continues;
/// retracts (announces the removal of) those the spill tier does not hold.
fn adopt_nvme(
    nvme: Option<&NvmeTier>,
    announcer: &Announcer,
    list: Vec<(kvnode_proto::BlockKey, crate::residency::RouterMeta)>,
) {
    let mut gone = Vec::new();
    for (key, meta) in list {
        let meta = Arc::new(meta);
        if !nvme.is_some_and(|n| n.adopt_announced(&key, &meta, false)) {
            gone.push(meta);
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
        // A taken-over arena's pages are resident already (the predecessor's memfd):
        // populating it again only pre-builds page tables, holding the mmap lock while the
        // first requests arrive (a 5 GiB tier: service gap 50 -> 24 ms). Pinning stays.
        let populate = config.populate && from.is_none();
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
                let dram = match h.dram {
                    Some(built) => built,
                    None => {
                        DramTier::restore(&tier(arena.len()), Arc::clone(&announcer), &h.image)?
                    }
                };
                drop(adopting);
                (arena, dram)
            }
        };
        let arena = Arc::new(arena);
        let dram = Arc::new(dram);
        // The spill files are opened and locked now (a start they refuse fails here); their
        // index is rebuilt on a thread while DRAM serves (store/lower.rs).
        let opening = if config.spill.dirs.is_empty() {
            None
        } else {
            Some(NvmeTier::lock(&config.spill, config.slab_bytes())?)
        };
        let tenants = Arc::new(Tenants::new(
            &config.tenants.with_default_quota(config.dram),
        ));
        let store = if opening.is_some() {
            Store::recovering(Arc::clone(&arena), dram, announcer, Arc::clone(&tenants))
        } else {
            Store::with_tenants(
                Arc::clone(&arena),
                dram,
                None,
                announcer,
                Arc::clone(&tenants),
            )
        };
        if let Some(list) = nvme_announced {
            let announcer = Arc::clone(store.announcer());
            store.on_nvme_attach(move |t| adopt_nvme(t.map(|t| &**t), &announcer, list));
        }
        let peers = Arc::new(Peers::new(
            &config.peer,
            Arc::clone(&store),
            Arc::clone(&metrics),
        )?);
        let stop_pinning = Arc::new(AtomicBool::new(false));
        arena.start_pinning(
            PinOptions {
                pin: config.pin,
                populate,
                chunk: PIN_CHUNK,
            },
            Arc::clone(&stop_pinning),
        );
        if let Some(o) = opening {
            recover_in_background(o, &store, &metrics, &stop_pinning)?;
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
    /// With `live`, the image is the delta since [`crate::dram::DramTier::live_image`].
    pub fn handover(&self, live: bool) -> Result<Handover, String> {
        let image = if live {
            self.store.dram().delta()
        } else {
            self.store.dram().image()
        }
        .map_err(|e| e.to_string())?;
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
            dram: None,
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

    /// Takes over the event stream of a predecessor that stopped on the same spill
    /// directory (a restart that continues its stream; the daemon's `restart_events`):
    /// blocks it announced on NVMe that the spill tier holds are adopted as announced (the
    /// rest removed); each block it announced in DRAM is announced on NVMe if the
    /// stop-time flush copied it down, then its DRAM copy is removed (a tier move). Runs
    /// once the NVMe tier is recovered (store/lower.rs); until then the router keeps what
    /// the predecessor told it.
    pub fn adopt_after_restart(
        &self,
        nvme: Vec<(kvnode_proto::BlockKey, crate::residency::RouterMeta)>,
        dram: Vec<(kvnode_proto::BlockKey, Arc<crate::residency::RouterMeta>)>,
    ) {
        let announcer = Arc::clone(self.store.announcer());
        self.store.on_nvme_attach(move |tier| {
            adopt_nvme(tier.map(|t| &**t), &announcer, nvme);
            let mut moved = 0u64;
            for (key, meta) in &dram {
                // Published: the NVMe store, before the DRAM removal.
                moved += u64::from(tier.is_some_and(|t| t.adopt_announced(key, meta, true)));
                announcer.retract(kvnode_events::Medium::CpuPinned, meta);
            }
            tracing::info!(
                dram = dram.len(),
                moved_to_nvme = moved,
                "KV events: DRAM blocks of the previous daemon announced as moved to NVMe (or removed)"
            );
        });
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
            spill_recovering: self.store.spill_phase() == crate::store::SpillPhase::Recovering,
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
