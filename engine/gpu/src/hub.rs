//! The daemon's GPU state: one copy thread per device (started on first use), the arena's
//! CUDA registration (background thread), and counters for the stats report.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvnode_proto::gpu::GpuStats;

use crate::register::HostRegistration;
use crate::runs::HostPieces;
use crate::worker::{DeviceWorker, WorkerConfig};
use crate::{GpuError, driver};

type Spawner = Box<dyn Fn(u32) -> Result<DeviceWorker, GpuError> + Send + Sync>;

#[derive(Debug, Default)]
struct RegState {
    registered: AtomicU64,
    /// Start of the registered range and its piece size (0 until registration starts).
    base: AtomicU64,
    piece: AtomicU64,
    status: Mutex<String>,
    reg: Mutex<Option<HostRegistration>>,
}

/// Counters the connections update.
#[derive(Debug, Default)]
pub struct GpuCounters {
    /// Buffers attached now.
    pub attached: AtomicU64,
    /// Bytes copied GPU -> arena.
    pub offload_bytes: AtomicU64,
    /// Bytes copied arena -> GPU.
    pub onload_bytes: AtomicU64,
}

/// GPU state shared by all connections.
pub struct GpuHub {
    spawn: Spawner,
    workers: Mutex<HashMap<u32, Arc<DeviceWorker>>>,
    reg: Arc<RegState>,
    /// Counters.
    pub counters: GpuCounters,
}

impl std::fmt::Debug for GpuHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuHub")
            .field("reg", &self.reg)
            .finish_non_exhaustive()
    }
}

impl GpuHub {
    /// Copy threads over the CUDA driver. Nothing touches the driver until first use.
    pub fn cuda(cfg: WorkerConfig) -> Self {
        Self::with_spawner(move |device| {
            driver::init()?;
            Ok(DeviceWorker::spawn(device, cfg, move || {
                crate::cuda::CudaBackend::new(device)
            }))
        })
    }

    /// Copy threads made by `spawn` (tests use the fake backend).
    pub fn with_spawner(
        spawn: impl Fn(u32) -> Result<DeviceWorker, GpuError> + Send + Sync + 'static,
    ) -> Self {
        let reg = RegState::default();
        *reg.status.lock().expect("status lock") = "not checked".into();
        Self {
            spawn: Box::new(spawn),
            workers: Mutex::new(HashMap::new()),
            reg: Arc::new(reg),
            counters: GpuCounters::default(),
        }
    }

    /// The copy thread of `device`, started on first use.
    pub fn worker(&self, device: u32) -> Result<Arc<DeviceWorker>, GpuError> {
        let mut w = self.workers.lock().expect("GPU workers lock");
        if let Some(x) = w.get(&device) {
            return Ok(Arc::clone(x));
        }
        let x = Arc::new((self.spawn)(device)?);
        w.insert(device, Arc::clone(&x));
        Ok(x)
    }

    /// Registers `[base, base + len)` with CUDA on a background thread in `piece`-byte pieces,
    /// if a driver is present. `keep` keeps the memory mapped while the thread runs; the
    /// registration lasts as long as this hub.
    pub fn start_registration(
        &self,
        base: *mut u8,
        len: u64,
        piece: u64,
        stop: Arc<AtomicBool>,
        keep: Arc<dyn Send + Sync>,
    ) -> std::thread::JoinHandle<()> {
        let st = Arc::clone(&self.reg);
        st.base.store(base as u64, Ordering::Relaxed);
        st.piece.store(piece, Ordering::Relaxed);
        let base = base as usize;
        std::thread::Builder::new()
            .name("kvnode-cureg".into())
            .spawn(move || {
                let _keep = keep;
                let st = st;
                let set = |s: String| *st.status.lock().expect("status lock") = s;
                if let Err(e) = driver::init() {
                    tracing::info!(reason = %e, "GPU path disabled");
                    set(e.to_string());
                    return;
                }
                set("registering".into());
                let t = std::time::Instant::now();
                // SAFETY: `keep` keeps the range mapped for the thread; the registration is
                // stored in the hub, which the owner of the mapping drops first.
                let r = unsafe {
                    HostRegistration::register(base as *mut u8, len, piece, &stop, |n| {
                        st.registered.store(n, Ordering::Relaxed);
                    })
                };
                let reg = match r {
                    Ok(reg) => {
                        tracing::info!(bytes = reg.bytes(), secs = t.elapsed().as_secs_f64(), "arena registered with CUDA");
                        set("ready".into());
                        reg
                    }
                    Err((reg, e)) => {
                        tracing::warn!(error = %e, registered = reg.bytes(), "cannot register the arena with CUDA; GPU copies run at pageable speed");
                        set(format!("ready (arena registration failed: {e})"));
                        reg
                    }
                };
                st.registered.store(reg.bytes(), Ordering::Relaxed);
                *st.reg.lock().expect("registration lock") = Some(reg);
            })
            .expect("spawn registration thread")
    }

    /// Leaves the arena's registration to the process's exit instead of undoing it when the
    /// hub drops: a daemon that handed its arena to a successor exits next, and unregistering
    /// costs ~17 ms per GiB on an H100 host (0.85 s for a 50 GiB arena), time the successor
    /// would wait at the barrier. The kernel drops the pins when the process exits.
    pub fn leave_registration(&self) {
        let reg = self.reg.reg.lock().expect("registration lock").take();
        std::mem::forget(reg);
    }

    /// The arena's registration pieces, which a copy's host rows must not span (one unbounded
    /// range before registration started: nothing is pinned then).
    pub fn host_pieces(&self) -> HostPieces {
        HostPieces {
            base: self.reg.base.load(Ordering::Relaxed) as usize,
            piece: self.reg.piece.load(Ordering::Relaxed),
        }
    }

    /// The stats section.
    pub fn stats(&self) -> GpuStats {
        let mut driver = self.reg.status.lock().expect("status lock").clone();
        if let Some(Err(e)) = driver::state() {
            driver = e.to_string();
        }
        GpuStats {
            driver,
            registered_bytes: self.reg.registered.load(Ordering::Relaxed),
            register_piece_bytes: self.reg.piece.load(Ordering::Relaxed),
            attached: self.counters.attached.load(Ordering::Relaxed),
            offload_bytes: self.counters.offload_bytes.load(Ordering::Relaxed),
            onload_bytes: self.counters.onload_bytes.load(Ordering::Relaxed),
        }
    }
}
