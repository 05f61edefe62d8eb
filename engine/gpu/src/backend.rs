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

/// One copy between device and host memory: `rows` runs of `len` bytes, each `dev_pitch` bytes
/// after the previous one on the device and back to back on the host. One row is a plain copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Device address of the first row (mapping base + extent offset).
    pub dev: u64,
    /// Host address inside the arena.
    pub host: usize,
    /// Bytes per row (all the bytes when `rows` is 1).
    pub len: u64,
    /// Rows, at least 1.
    pub rows: u64,
    /// Device bytes from one row's start to the next, at least `len`; unused for one row.
    pub dev_pitch: u64,
    /// A fence may follow this copy: it ends a unit (a page) that a cancel must not split.
    /// The copy thread closes batches only after such copies.
    pub unit_end: bool,
}

impl CopyOp {
    /// A contiguous copy of `len` bytes.
    pub fn linear(dev: u64, host: usize, len: u64) -> Self {
        Self {
            dev,
            host,
            len,
            rows: 1,
            dev_pitch: len,
            unit_end: true,
        }
    }

    /// `rows` device runs of `width` bytes, `pitch` apart, to or from one host run. Back-to-back
    /// rows (`pitch == width`) or a single row make a linear copy.
    pub fn strided(dev: u64, host: usize, width: u64, rows: u64, pitch: u64) -> Self {
        if rows <= 1 || pitch == width {
            Self::linear(dev, host, width * rows)
        } else {
            Self {
                dev,
                host,
                len: width,
                rows,
                dev_pitch: pitch,
                unit_end: true,
            }
        }
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.rows
    }

    /// `(device address, host address)` of each row.
    pub fn row_addrs(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        (0..self.rows).map(|r| {
            (
                self.dev + r * self.dev_pitch,
                self.host + (r * self.len) as usize,
            )
        })
    }

    /// Appends `next` to this copy when both are linear, `next` starts where this one ends on
    /// both sides, and the result stays within `max` bytes.
    pub fn merge(&mut self, next: &Self, max: u64) -> bool {
        let fits = self.rows == 1
            && next.rows == 1
            && self.dev + self.len == next.dev
            && self.host + self.len as usize == next.host
            && self.len + next.len <= max;
        if fits {
            self.len += next.len;
            self.dev_pitch = self.len;
            self.unit_end = next.unit_end;
        }
        fits
    }
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
    /// Enqueues one copy (all its rows) on the direction's stream.
    ///
    /// # Safety
    /// `op.host .. op.host + op.bytes()` is valid host memory that stays valid, and is not
    /// otherwise accessed, until a fence recorded after this call has been waited on.
    unsafe fn copy(&mut self, dir: Dir, op: CopyOp) -> Result<(), GpuError>;
    /// Records a fence after everything enqueued so far on the direction's stream.
    fn fence(&mut self, dir: Dir) -> Result<Self::Fence, GpuError>;
    /// Blocks until the fence's work is complete.
    fn wait(&mut self, f: Self::Fence) -> Result<(), GpuError>;
}
