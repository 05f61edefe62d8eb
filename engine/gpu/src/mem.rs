//! Device and page-locked host buffers, IPC export, and timed plain copies (bench baseline).

use std::time::Instant;

use cudarc::driver::sys;

use crate::GpuError;
use crate::driver::{bind_primary, check};

/// A `cuMemAlloc` allocation; freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    /// Device address.
    pub ptr: u64,
    /// Bytes.
    pub len: u64,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device` (binding its primary context to this thread).
    pub fn alloc(device: u32, len: u64) -> Result<Self, GpuError> {
        bind_primary(device)?;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local; a context is current.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&raw mut ptr, len as usize)
        })?;
        Ok(Self { ptr, len })
    }

    /// Exports the allocation as a CUDA IPC handle.
    pub fn ipc_handle(&self) -> Result<[u8; 64], GpuError> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: out-pointer to a local; ptr is a live allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&raw mut h, self.ptr)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Sets every byte to `v` (synchronously).
    pub fn fill(&self, v: u8) -> Result<(), GpuError> {
        // SAFETY: within the allocation.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, v, self.len as usize)
        })?;
        // SAFETY: no arguments.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Copies `dst.len()` bytes from device offset `off` (synchronously).
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        assert!(
            off + dst.len() as u64 <= self.len,
            "read outside the buffer"
        );
        // SAFETY: both ranges in bounds.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + off, dst.len())
        })
    }

    /// Copies `src` to device offset `off` (synchronously).
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), GpuError> {
        assert!(
            off + src.len() as u64 <= self.len,
            "write outside the buffer"
        );
        // SAFETY: both ranges in bounds.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + off, src.as_ptr().cast(), src.len())
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: our allocation.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// A `cuMemAllocHost` (page-locked) buffer; freed on drop.
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
}

impl PinnedHost {
    /// Allocates `len` page-locked bytes (a context must be current).
    pub fn alloc(len: usize) -> Result<Self, GpuError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuMemAllocHost", unsafe {
            sys::cuMemAllocHost_v2(&raw mut p, len)
        })?;
        Ok(Self { ptr: p.cast(), len })
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: our allocation.
        unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// Plain pinned `cuMemcpyAsync` bandwidth in bytes/s: `iters` copies of `page` bytes walking
/// `dev` and `host`, one stream, one synchronize at the end. `to_device` picks the direction.
pub fn pinned_copy_bandwidth(
    dev: &DeviceBuffer,
    host: &PinnedHost,
    page: u64,
    iters: usize,
    to_device: bool,
) -> Result<f64, GpuError> {
    let slots = (dev.len.min(host.len as u64) / page).max(1);
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer; context current (dev was allocated on this thread).
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&raw mut s, 1)
    })?;
    let t = Instant::now();
    for i in 0..iters as u64 {
        let o = (i % slots) * page;
        // SAFETY: o + page within both buffers.
        let r = unsafe {
            let h = host.ptr.add(o as usize).cast();
            if to_device {
                sys::cuMemcpyHtoDAsync_v2(dev.ptr + o, h, page as usize, s)
            } else {
                sys::cuMemcpyDtoHAsync_v2(h, dev.ptr + o, page as usize, s)
            }
        };
        check("cuMemcpyAsync", r)?;
    }
    // SAFETY: s is our stream.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(s)
    })?;
    let secs = t.elapsed().as_secs_f64();
    // SAFETY: idle stream of ours.
    unsafe { sys::cuStreamDestroy_v2(s) };
    Ok((iters as u64 * page) as f64 / secs)
}
