//! The copy engine seam: CUDA in production, an in-memory fake with a fence gate in tests.

use crate::GpuError;

/// Copy direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// GPU -> host arena (offload).
    DeviceToHost,
    /// Host arena -> GPU (onload).
    HostToDevice,
}

/// One contiguous copy between a device address and a host address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Device address (mapping base + extent offset).
    pub dev: u64,
    /// Host address inside the arena.
    pub host: usize,
    /// Bytes.
    pub len: u64,
}

/// What the device thread drives. Calls happen on that one thread, in order.
pub trait Backend: 'static {
    /// A point in a stream's work.
    type Fence;
    /// Opens an IPC handle; returns the device address of its allocation and the
    /// allocation's size.
    fn open(&mut self, handle: &[u8; 64]) -> Result<(u64, u64), GpuError>;
    /// Closes a mapping opened by [`Backend::open`]. No copy on it is in flight.
    fn close(&mut self, dev: u64) -> Result<(), GpuError>;
    /// Enqueues one copy on the direction's stream.
    ///
    /// # Safety
    /// `op.host .. op.host + op.len` is valid host memory that stays valid, and is not
    /// otherwise accessed, until a fence recorded after this call has been waited on.
    unsafe fn copy(&mut self, dir: Dir, op: CopyOp) -> Result<(), GpuError>;
    /// Records a fence after everything enqueued so far on the direction's stream.
    fn fence(&mut self, dir: Dir) -> Result<Self::Fence, GpuError>;
    /// Blocks until the fence's work is complete.
    fn wait(&mut self, f: Self::Fence) -> Result<(), GpuError>;
}
