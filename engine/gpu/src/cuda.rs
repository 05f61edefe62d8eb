//! The CUDA backend: one context per device thread, a stream per direction, pooled events.

use cudarc::driver::sys;

use crate::GpuError;
use crate::backend::{Backend, CopyOp, Dir};
use crate::driver::{bind_primary, check};

/// An event recorded by [`CudaBackend`]'s `fence` (only it can make one).
#[derive(Debug)]
pub struct CudaFence(sys::CUevent);

/// Copies on `device` through its primary context.
#[derive(Debug)]
pub struct CudaBackend {
    d2h: sys::CUstream,
    h2d: sys::CUstream,
    events: Vec<sys::CUevent>,
}

fn stream() -> Result<sys::CUstream, GpuError> {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; a context is current.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &raw mut s,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })?;
    Ok(s)
}

impl CudaBackend {
    /// Binds the calling thread to `device` and creates its streams.
    pub fn new(device: u32) -> Result<Self, GpuError> {
        bind_primary(device)?;
        Ok(Self {
            d2h: stream()?,
            h2d: stream()?,
            events: Vec::new(),
        })
    }

    fn stream(&self, dir: Dir) -> sys::CUstream {
        match dir {
            Dir::DeviceToHost => self.d2h,
            Dir::HostToDevice => self.h2d,
        }
    }
}

impl Backend for CudaBackend {
    type Fence = CudaFence;

    fn open(&mut self, handle: &[u8; 64]) -> Result<(u64, u64), GpuError> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = (*s).cast_signed();
        }
        let mut dev = 0;
        // SAFETY: out-pointer to a local; the handle is plain bytes the driver validates.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &raw mut dev,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: out-pointers to locals; dev is a live mapping.
        let r = check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, dev)
        });
        if let Err(e) = r {
            // SAFETY: closing the mapping just opened.
            unsafe { sys::cuIpcCloseMemHandle(dev) };
            return Err(e);
        }
        Ok((dev, (size as u64).saturating_sub(dev - base)))
    }

    fn close(&mut self, dev: u64) -> Result<(), GpuError> {
        // SAFETY: dev came from open and no copy on it is in flight (caller's contract).
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(dev)
        })
    }

    unsafe fn copy(&mut self, dir: Dir, op: CopyOp) -> Result<(), GpuError> {
        let s = self.stream(dir);
        match dir {
            // SAFETY: host range valid and exclusive until the next fence completes (contract).
            Dir::DeviceToHost => check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(op.host as *mut _, op.dev, op.len as usize, s)
            }),
            // SAFETY: as above.
            Dir::HostToDevice => check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(op.dev, op.host as *const _, op.len as usize, s)
            }),
        }
    }

    fn fence(&mut self, dir: Dir) -> Result<CudaFence, GpuError> {
        let e = if let Some(e) = self.events.pop() {
            e
        } else {
            let mut e = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; our context is current.
            check("cuEventCreate", unsafe {
                sys::cuEventCreate(
                    &raw mut e,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            })?;
            e
        };
        // SAFETY: e and the stream belong to this thread's context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(e, self.stream(dir))
        })?;
        Ok(CudaFence(e))
    }

    fn wait(&mut self, f: CudaFence) -> Result<(), GpuError> {
        // SAFETY: f.0 was created and recorded by fence() (the field is private).
        let r = check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(f.0)
        });
        self.events.push(f.0);
        r
    }
}
