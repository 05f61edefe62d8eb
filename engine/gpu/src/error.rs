//! The GPU path's error type.

use kvnode_proto::gpu::LayoutError;

/// A GPU operation that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// libcuda.so could not be loaded.
    #[error(
        "no CUDA driver: libcuda.so (the NVIDIA driver) was not found on this node, so GPU ops are unavailable; install the driver or use put/get"
    )]
    NoDriver,
    /// A driver call failed.
    #[error("CUDA {call} failed: {name} ({code})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// Numeric CUresult.
        code: u32,
        /// Its name.
        name: String,
    },
    /// The device ordinal does not exist.
    #[error(
        "CUDA device {device} does not exist: this node has {count} (check CUDA_VISIBLE_DEVICES matches the engine's)"
    )]
    NoDevice {
        /// Asked for.
        device: u32,
        /// Present.
        count: u32,
    },
    /// The handle or layout was refused.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The device thread is gone (it failed to start or panicked).
    #[error("the GPU copy thread for device {0} has stopped; see the daemon log")]
    WorkerGone(u32),
    /// A client without the daemon's arena mapping asked to register it.
    #[error(
        "this client has no arena mapping (its tenant has share_arena = false): nothing to register"
    )]
    NoArenaMapping,
}
