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
/// after the previous one on the device and `host_pitch` bytes on the host (back to back,
/// `host_pitch == len`, for a page's objects into its block). One row is a plain copy.
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
    /// Host bytes from one row's start to the next, at least `len`; unused for one row.
    pub host_pitch: u64,
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
            host_pitch: len,
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
                host_pitch: width,
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
                self.host + (r * self.host_pitch) as usize,
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
            self.host_pitch = self.len;
            self.unit_end = next.unit_end;
        }
        fits
    }

    /// Appends `next` (one row of this op's width) as a further row when it lies one pitch
    /// after this op's last row on both sides (the pitches are set by the second row; both
    /// must be at least the width, so rows never overlap) and the result stays within `max`
    /// bytes. Rows of a pitched op may be anywhere on the host: a layer's run of pages is one
    /// op even though each page's block is a separate arena slot.
    pub fn fuse_row(&mut self, next: &Self, max: u64) -> bool {
        if next.rows != 1 || next.len != self.len || self.bytes() + next.len > max {
            return false;
        }
        if self.rows == 1 {
            let (Some(dp), Some(hp)) = (
                next.dev.checked_sub(self.dev),
                (next.host as u64).checked_sub(self.host as u64),
            ) else {
                return false;
            };
            if dp < self.len || hp < self.len {
                return false;
            }
            (self.dev_pitch, self.host_pitch, self.rows) = (dp, hp, 2);
        } else {
            let fits = next.dev == self.dev + self.rows * self.dev_pitch
                && next.host as u64 == self.host as u64 + self.rows * self.host_pitch;
            if !fits {
                return false;
            }
            self.rows += 1;
        }
        self.unit_end = next.unit_end;
        true
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
