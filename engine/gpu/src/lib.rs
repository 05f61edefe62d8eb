//! kvnode-gpu: the GPU path: CUDA driver loaded at run time, arena registration, IPC mappings,
//! and one copy thread per device.
//!
//! ```text
//!  connection task ──Cmd──> device thread (kvnode-gpuN): IPC open/close, fenced copy batches
//!        ^                         │ cuMemcpy{DtoH,HtoD,2D}Async on its own streams, events
//!        └──── oneshot reply <─────┘ (sent only after every issued copy completed)
//!  registration thread (kvnode-cureg): cuMemHostRegister(arena, portable, ≤ 4 GiB pieces)
//! ```
//!
//! With no driver every entry point returns [`GpuError::NoDriver`]; nothing panics.
//!
//! - [`driver`]: loading the driver, result checks, contexts.
//! - [`backend`]: the copy-engine seam ([`cuda`] in production, [`fake`] in tests).
//! - [`worker`]: the per-device copy thread and its cancellable tickets.
//! - [`hub`]: the daemon's GPU state (workers, registration, counters).
//! - [`register`]: host-memory registration in pieces.
//! - [`plan`]: a page of a layout as copies (one strided copy per regular page, merging).
//! - [`layered`]: a layer-wise onload's copies (layer 0 of every page first; runs of pages fused).
//! - [`runs`]: pages grouped into runs that step evenly on device and host (one pitched copy each).
//! - [`mem`]: device and pinned buffers, IPC export, plain-copy bandwidth (bench baseline).

pub mod backend;
pub mod cuda;
pub mod driver;
mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod hub;
pub mod layered;
pub mod mem;
pub mod plan;
pub mod register;
pub mod runs;
pub mod worker;

pub use backend::{CopyOp, Dir};
pub use error::GpuError;
pub use hub::GpuHub;
pub use layered::{LayerPlan, layer_ops, page_order_layer_ops};
pub use plan::page_ops;
pub use runs::HostPieces;
pub use worker::{Canceller, CopyTicket, DeviceWorker, WorkerConfig};
