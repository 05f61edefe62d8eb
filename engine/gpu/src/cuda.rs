//! The CUDA backend: one context per device thread, a stream per direction, pooled events.
//! A copy of one row is a `cuMemcpy{DtoH,HtoD}Async`; a strided copy is one `cuMemcpy2DAsync`
//! (the op's device and host pitches), or one copy per row when a pitch exceeds the device's
//! `CU_DEVICE_ATTRIBUTE_MAX_PITCH`.

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
    /// Largest pitch `cuMemcpy2DAsync` takes on this device.
    max_pitch: u64,
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
        let (mut dev, mut max_pitch) = (0, 0);
        // SAFETY: out-pointers to locals; the ordinal was checked by bind_primary.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut dev, device.cast_signed())
        })?;
        // SAFETY: as above.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &raw mut max_pitch,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH,
                dev,
            )
        })?;
        Ok(Self {
            d2h: stream()?,
            h2d: stream()?,
            events: Vec::new(),
            max_pitch: u64::try_from(max_pitch).unwrap_or(0),
        })
    }

    /// Enqueues `len` bytes between `dev` and `host`.
    ///
    /// # Safety
    /// As [`Backend::copy`], for `host .. host + len`.
    unsafe fn copy_1d(&self, dir: Dir, dev: u64, host: usize, len: u64) -> Result<(), GpuError> {
        let s = self.stream(dir);
        match dir {
            // SAFETY: host range valid and exclusive until the next fence completes (contract).
            Dir::DeviceToHost => check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(host as *mut _, dev, len as usize, s)
            }),
            // SAFETY: as above.
            Dir::HostToDevice => check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host as *const _, len as usize, s)
            }),
        }
    }

    /// Enqueues a strided op as one 2D copy.
    ///
    /// # Safety
    /// As [`Backend::copy`].
    unsafe fn copy_2d(&self, dir: Dir, op: CopyOp) -> Result<(), GpuError> {
        let (host, device) = (
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        );
        let mut p = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: 0,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: 0,
            dstArray: std::ptr::null_mut(),
            dstPitch: 0,
            WidthInBytes: op.len as usize,
            Height: op.rows as usize,
        };
        match dir {
            Dir::DeviceToHost => {
                (p.srcDevice, p.srcPitch) = (op.dev, op.dev_pitch as usize);
                (p.dstMemoryType, p.dstHost, p.dstPitch) =
                    (host, op.host as *mut _, op.host_pitch as usize);
            }
            Dir::HostToDevice => {
                (p.srcMemoryType, p.srcHost, p.srcPitch) =
                    (host, op.host as *const _, op.host_pitch as usize);
                (p.dstDevice, p.dstPitch) = (op.dev, op.dev_pitch as usize);
            }
        }
        // SAFETY: p describes the op's rows, whose host range is valid and exclusive until the
        // next fence completes (contract); the driver reads p before returning.
        check("cuMemcpy2DAsync", unsafe {
            sys::cuMemcpy2DAsync_v2(&raw const p, self.stream(dir))
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
        if op.rows == 1 {
            // SAFETY: the caller's contract covers the op's one row.
            return unsafe { self.copy_1d(dir, op.dev, op.host, op.len) };
        }
        if op.dev_pitch.max(op.host_pitch) <= self.max_pitch {
            // SAFETY: the caller's contract.
            return unsafe { self.copy_2d(dir, op) };
        }
        for (dev, host) in op.row_addrs() {
            // SAFETY: each row lies inside the op's host range (the caller's contract).
            unsafe { self.copy_1d(dir, dev, host, op.len) }?;
        }
        Ok(())
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
