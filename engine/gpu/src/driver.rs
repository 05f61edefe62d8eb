//! Loading the CUDA driver once (dlopen), checking results, and making a device's context current.

use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::GpuError;

static INIT: OnceLock<Result<(), GpuError>> = OnceLock::new();

/// Loads libcuda and runs `cuInit` once per process. Never panics: without a driver this
/// returns [`GpuError::NoDriver`] (cudarc's loader would panic, so presence is checked first).
pub fn init() -> Result<(), GpuError> {
    INIT.get_or_init(|| {
        // SAFETY: only tries dlopen on the library's candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: cuInit has no preconditions; the library is present.
        check("cuInit", unsafe { sys::cuInit(0) })
    })
    .clone()
}

/// The outcome of [`init`] if it has run, without initialising.
pub fn state() -> Option<Result<(), GpuError>> {
    INIT.get().cloned()
}

/// Whether [`init`] succeeded, without initialising.
pub fn ready() -> bool {
    matches!(INIT.get(), Some(Ok(())))
}

/// Maps a CUresult to a [`GpuError`].
pub fn check(call: &'static str, r: sys::CUresult) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            call,
            code: r as u32,
            name: format!("{r:?}"),
        })
    }
}

/// Number of CUDA devices.
pub fn device_count() -> Result<u32, GpuError> {
    init()?;
    let mut n = 0;
    // SAFETY: writes one int; the driver is initialised.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&raw mut n)
    })?;
    Ok(n as u32)
}

/// Retains `device`'s primary context and makes it current on the calling thread. The
/// primary context is shared with the CUDA runtime (torch) of this process, and never released:
/// kvnode keeps it for the process lifetime.
pub fn bind_primary(device: u32) -> Result<sys::CUcontext, GpuError> {
    let count = device_count()?;
    if device >= count {
        return Err(GpuError::NoDevice { device, count });
    }
    let mut dev = 0;
    // SAFETY: out-pointer to a local; ordinal checked above.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&raw mut dev, device.cast_signed())
    })?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; dev is valid.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&raw mut ctx, dev)
    })?;
    // SAFETY: ctx was just retained.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
    Ok(ctx)
}

/// Makes a context current on the calling thread: the current one if any, else device 0's
/// primary context.
pub fn ensure_context() -> Result<(), GpuError> {
    init()?;
    let mut cur = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&raw mut cur)
    })?;
    if cur.is_null() {
        bind_primary(0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_says_whether_a_driver_is_present_and_never_panics() {
        // Both branches assert: CI has no libcuda (every call says "no CUDA driver"); on a GPU
        // machine init succeeds or names the failing CUDA call, and a device index past the
        // last one is a typed error, not a fault.
        // SAFETY: dlopen probe only.
        if unsafe { sys::is_culib_present() } {
            let r = init();
            assert_ne!(r, Err(GpuError::NoDriver), "libcuda is present");
            assert_eq!(ready(), r.is_ok());
            if r.is_ok() {
                let n = device_count().expect("cuDeviceGetCount after a successful cuInit");
                assert!(
                    matches!(bind_primary(n), Err(GpuError::NoDevice { device, count }) if device == n && count == n)
                );
            }
            return;
        }
        assert_eq!(init(), Err(GpuError::NoDriver));
        assert_eq!(device_count(), Err(GpuError::NoDriver));
        assert!(bind_primary(0).is_err());
        assert!(!ready());
        assert!(GpuError::NoDriver.to_string().contains("no CUDA driver"));
    }
}
