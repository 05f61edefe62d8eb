//! Registering host memory with CUDA (page-locked, portable) in pieces, and unregistering it.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use crate::GpuError;
use crate::driver::{check, ensure_context};

/// Largest single registration. A pitched copy's host rows must lie in one registration, so
/// this bounds a layer-wise onload's runs (4 GiB: 448 blocks of 9 MiB in 64 MiB slabs, against
/// 112 with 1 GiB pieces: copies of ~4.6 MiB instead of ~1.8 MiB for a 512-page prefix, see
/// `runs.rs`); it also bounds how long one `cuMemHostRegister` call holds up a stop (4.6 GiB
/// of resident memory took 0.18 s on the H200 host, docs/ttft.md "Issue 44 §3") and how far
/// apart the progress reports are.
pub const MAX_PIECE: u64 = 4 << 30;

/// The piece size for an arena cut into `slab`-byte slabs: the largest multiple of the slab
/// not above [`MAX_PIECE`], so no slot straddles two registrations (a copy stays in one of them).
pub fn piece_for_slab(slab: u64) -> u64 {
    if slab == 0 || slab >= MAX_PIECE {
        return slab.max(1);
    }
    MAX_PIECE / slab * slab
}

/// Host ranges registered with CUDA; unregistered on drop.
#[derive(Debug, Default)]
pub struct HostRegistration {
    pieces: Vec<(usize, usize)>,
}

// SAFETY: holds addresses only; unregistering is thread-safe in the driver.
unsafe impl Send for HostRegistration {}
// SAFETY: as above (no interior access).
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `[ptr, ptr + len)` in `piece`-byte pieces (`CU_MEMHOSTREGISTER_PORTABLE`: pinned
    /// for every context), calling `progress` with the bytes done after each piece and
    /// stopping early when `stop` is set. Makes a context current if none is (device 0's
    /// primary context). On failure, the pieces already registered are returned with the error.
    ///
    /// # Safety
    /// The range is mapped memory of this process and stays mapped until this value drops.
    pub unsafe fn register(
        ptr: *mut u8,
        len: u64,
        piece: u64,
        stop: &AtomicBool,
        mut progress: impl FnMut(u64),
    ) -> Result<Self, (Self, GpuError)> {
        let mut reg = Self::default();
        if let Err(e) = ensure_context() {
            return Err((reg, e));
        }
        let piece = piece.clamp(1, MAX_PIECE);
        let mut off = 0u64;
        while off < len && !stop.load(Ordering::Relaxed) {
            let n = piece.min(len - off) as usize;
            // SAFETY: in bounds of the caller's mapping.
            let p = unsafe { ptr.add(off as usize) };
            // SAFETY: registering mapped memory; the caller keeps it mapped.
            let r =
                unsafe { sys::cuMemHostRegister_v2(p.cast(), n, sys::CU_MEMHOSTREGISTER_PORTABLE) };
            if r != sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
                if let Err(e) = check("cuMemHostRegister", r) {
                    return Err((reg, e));
                }
                reg.pieces.push((p as usize, n));
            }
            off += n as u64;
            progress(off);
        }
        Ok(reg)
    }

    /// Bytes registered by this value.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.1 as u64).sum()
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.pieces.is_empty() || ensure_context().is_err() {
            return;
        }
        for &(p, _) in &self.pieces {
            // SAFETY: p was registered by us and is still mapped (contract of `register`).
            unsafe { sys::cuMemHostUnregister(p as *mut _) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_whole_slabs_of_at_most_four_gib() {
        assert_eq!(piece_for_slab(64 << 20), 4 << 30);
        assert_eq!(piece_for_slab(6 << 20), 682 * (6 << 20));
        assert_eq!(piece_for_slab(2 << 30), 4 << 30);
        assert_eq!(piece_for_slab(3 << 30), 3 << 30);
        assert_eq!(piece_for_slab(8 << 30), 8 << 30);
        assert!(piece_for_slab(6 << 20) <= MAX_PIECE);
    }
}
