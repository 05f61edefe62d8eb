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

/// Faulted in at a time before a piece is registered ([`prefault`]).
pub const PREFAULT_CHUNK: usize = 2 << 20;

/// Maps every page of `[ptr, ptr + len)` into this process's page tables, `chunk` bytes per
/// `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+; on older kernels, or where it is refused, one
/// byte per page is read), stopping early when `stop` is set. Returns the bytes done.
///
/// Why: `cuMemHostRegister` pins a piece's pages under the process's mmap lock, faulting in
/// every page not mapped yet. A successor that took an arena over has mapped none of it, and
/// a 4 GiB piece then held the lock for 0.2-0.5 s on an H100 host (10 M blocks, 50 GiB:
/// request stalls of up to 0.54 s after the hand-over), while every page fault of the
/// request threads waited. Faulted in 2 MiB at a time first, each hold is short, and the
/// registration of mapped pages only pins them. The bytes are not changed.
///
/// # Safety
/// The range is mapped memory of this process, shared or private, writable.
pub unsafe fn prefault(ptr: *mut u8, len: usize, chunk: usize, stop: &AtomicBool) -> usize {
    let chunk = chunk.max(4096);
    let mut off = 0usize;
    while off < len && !stop.load(Ordering::Relaxed) {
        let n = chunk.min(len - off);
        // SAFETY: in bounds of the caller's mapping.
        let p = unsafe { ptr.add(off) };
        // SAFETY: advising a range of our own mapping; it changes no byte.
        if unsafe { libc::madvise(p.cast(), n, libc::MADV_POPULATE_WRITE) } != 0 {
            for o in (0..n).step_by(4096) {
                // SAFETY: in-bounds volatile read of mapped memory; it changes no byte.
                unsafe { std::ptr::read_volatile(p.add(o)) };
            }
        }
        off += n;
    }
    off
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
            // SAFETY: the caller's mapped range (contract of this function).
            if unsafe { prefault(p, n, PREFAULT_CHUNK, stop) } < n {
                break;
            }
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

    /// Pages of `[p, p + len)` in this process's page tables (mincore).
    fn resident(p: *mut u8, len: usize) -> usize {
        let mut v = vec![0u8; len.div_ceil(4096)];
        // SAFETY: a page-aligned mapping of `len` bytes; `v` has one byte per page.
        assert_eq!(unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) }, 0);
        v.iter().filter(|b| **b & 1 == 1).count()
    }

    #[test]
    fn prefault_maps_every_page_of_a_shared_mapping_and_changes_no_byte() {
        let len = 16usize << 20;
        // SAFETY: a fresh shared anonymous mapping, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let p = p.cast::<u8>();
        // One page written before: its byte must survive.
        // SAFETY: in bounds of the mapping.
        unsafe { p.add(5 << 20).write(0xA5) };
        assert!(resident(p, len) < 16, "a fresh mapping is not resident");
        let stop = AtomicBool::new(false);
        // SAFETY: the mapping above.
        assert_eq!(unsafe { prefault(p, len, PREFAULT_CHUNK, &stop) }, len);
        assert_eq!(resident(p, len), len / 4096);
        // SAFETY: in bounds of the mapping.
        assert_eq!(unsafe { p.add(5 << 20).read() }, 0xA5);
        // A stop set before: nothing more is done.
        stop.store(true, Ordering::Relaxed);
        // SAFETY: the mapping above.
        assert_eq!(unsafe { prefault(p, len, PREFAULT_CHUNK, &stop) }, 0);
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(p.cast(), len) };
    }

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
