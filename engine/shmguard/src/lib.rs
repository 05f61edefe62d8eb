//! Copies through a client's shared mapping that survive the client shrinking the file.
//!
//! A process that maps another process's memfd `MAP_SHARED` gets SIGBUS when it touches a page
//! the owner has truncated away; unhandled, that kills the process. This crate applies the
//! technique libwayland-server uses for `wl_shm` buffers (`wl_shm_buffer_begin_access`):
//!
//! ```text
//!  SharedMapping::guarded(|g| g.read(..) / g.write(..))
//!    push Access{mapping} on this thread's chain ──► copies ──► pop ──► poisoned? Faulted : Ok
//!                                                      │ SIGBUS at addr
//!                         on_sigbus: addr in an Access of this thread?
//!                           yes: poison the mapping, mmap(MAP_FIXED|MAP_PRIVATE|MAP_ANONYMOUS)
//!                                zero pages over all of it, return (the copy finishes harmlessly)
//!                           no:  restore the previous disposition, return (fault re-delivered)
//! ```
//!
//! - One handler per process, installed by the first [`install`]; accesses check it is still
//!   the disposition (one `sigaction` query per access).
//! - Each thread keeps its own chain of active accesses, so daemon threads copy concurrently
//!   and accesses nest (a fault is charged to the innermost access whose mapping holds it).
//! - A fault poisons the mapping for every thread: any access that overlaps or follows it
//!   returns [`AccessError::Faulted`], so bytes read from a faulted copy are never trusted.
//! - Other SIGBUS users: a fault outside every guarded access of the faulting thread, or a
//!   SIGBUS sent by a process, is handed back to the disposition found at installation (in a
//!   Rust binary std's stack-overflow handler, which makes it fatal as before), and ours stays
//!   uninstalled from then on; [`installed`] reports it and accesses return
//!   [`AccessError::Unguarded`] instead of copying unprotected.
//!
//! The mapping itself is a `memmap2::MmapRaw` (`MAP_SHARED`, read-write, of the client's
//! memfd: every flag it needs; unmapped on drop). The guard is not: no crate catches SIGBUS on
//! a shared mapping and swaps zero pages in under the faulting copy (memmap2 documents the
//! SIGBUS on truncation and leaves it to the caller), so the handler, its per-thread chain and
//! its `mmap(MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS)` stay raw libc in [`handler`]. That
//! `MAP_FIXED` replaces pages inside the range memmap2 owns; the range stays the same, so
//! memmap2's `munmap` on drop still unmaps exactly it.

mod handler;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering, compiler_fence};

use memmap2::{MmapOptions, MmapRaw};

pub use handler::{install, installed};

/// Why a guarded access did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    /// A page of the mapping stopped being backed during (or before) the access: the owner
    /// shrank the file, or a tmpfs/hugetlbfs ran out of pages. The mapping now holds private
    /// zero pages and every later access fails the same way; map the file again.
    #[error(
        "the shared mapping faulted (SIGBUS): its file shrank below the mapping or its pages could not be allocated"
    )]
    Faulted,
    /// The SIGBUS handler is not (or no longer) the process's disposition, so a mapped copy
    /// could kill the process; copy through the descriptor (pread/pwrite) instead.
    #[error(
        "the SIGBUS guard is not installed (another SIGBUS user replaced it); nothing was copied"
    )]
    Unguarded,
}

/// An extent that does not fit the mapping (a caller bug: nothing was copied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("extent [{offset}, {offset}+{len}) lies outside the {size}-byte mapping")]
pub struct OutOfRange {
    /// Start of the extent.
    pub offset: usize,
    /// Length of the extent.
    pub len: usize,
    /// Length of the mapping.
    pub size: usize,
}

/// `len` bytes of a file mapped `MAP_SHARED` read-write; unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    /// Start and length of `map`, copied out so the signal handler reads plain fields only.
    base: NonNull<u8>,
    len: usize,
    /// Set by the handler (before it swaps the pages) when any thread faults on the mapping.
    poisoned: AtomicBool,
    /// Owns the range: unmapped on drop (the zero-page replacement too, same range).
    _map: MmapRaw,
}

// SAFETY: the mapping is process memory with no thread affinity; its bytes are only touched
// through `Guarded` copies of raw pointers, and `poisoned` is atomic. (`base` is what keeps
// the auto traits off; `MmapRaw` is Send + Sync.)
unsafe impl Send for SharedMapping {}
// SAFETY: as above; concurrent accesses from several threads are guarded per thread.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `fd` shared, read-write. Call [`install`] before guarded accesses.
    ///
    /// Errors: `mmap` failed (`EACCES`: the descriptor is not open read-write; `ENODEV`: the
    /// file system cannot map it; `ENOMEM`: no address space).
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        let map = MmapOptions::new().len(len).map_raw(fd.as_raw_fd())?;
        Ok(Self {
            base: NonNull::new(map.as_mut_ptr()).ok_or(std::io::ErrorKind::AddrNotAvailable)?,
            len,
            poisoned: AtomicBool::new(false),
            _map: map,
        })
    }

    /// Mapped length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a mapping holds at least one byte); here for clippy's `len` convention.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a fault has replaced the mapping's pages (every access now fails).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }

    /// Runs `f` with copies into and out of the mapping that cannot kill the process.
    ///
    /// Returns `f`'s result only when no page of the mapping faulted before or during the
    /// access; otherwise `Faulted` (bytes `f` read must be discarded, bytes it wrote may have
    /// landed partly). `Unguarded` when the handler is not installed; `f` then does not run.
    pub fn guarded<R>(&self, f: impl FnOnce(&Guarded<'_>) -> R) -> Result<R, AccessError> {
        if !installed() {
            return Err(AccessError::Unguarded);
        }
        if self.is_poisoned() {
            return Err(AccessError::Faulted);
        }
        let access = handler::Access::new(self);
        let r = {
            let _entry = handler::Entry::push(&access);
            f(&Guarded {
                map: self,
                _not_sync: std::marker::PhantomData,
            })
        };
        compiler_fence(Ordering::SeqCst);
        if self.is_poisoned() {
            return Err(AccessError::Faulted);
        }
        Ok(r)
    }

    /// Runs `f` with copies that are not guarded (no handler, no thread-local bookkeeping).
    ///
    /// # Safety
    ///
    /// No page of the mapping may fault during `f`: the file cannot shrink below the mapping
    /// (`F_SEAL_SHRINK` holds, or the caller owns the file) and its pages are allocated or
    /// can be. Otherwise a copy raises a SIGBUS that kills the process.
    pub unsafe fn unguarded<R>(&self, f: impl FnOnce(&Guarded<'_>) -> R) -> R {
        f(&Guarded {
            map: self,
            _not_sync: std::marker::PhantomData,
        })
    }
}

/// Copies allowed inside [`SharedMapping::guarded`], on the thread that runs it only.
#[derive(Debug)]
pub struct Guarded<'a> {
    map: &'a SharedMapping,
    /// `!Sync`: a `&Guarded` may not reach another thread, whose chain does not hold the access.
    _not_sync: std::marker::PhantomData<*const ()>,
}

impl Guarded<'_> {
    fn check(&self, offset: usize, len: usize) -> Result<*mut u8, OutOfRange> {
        let size = self.map.len;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(OutOfRange { offset, len, size });
        }
        // SAFETY: offset <= size, inside (or one past) our allocation.
        Ok(unsafe { self.map.base.as_ptr().add(offset) })
    }

    /// Copies `src` into the mapping at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), OutOfRange> {
        let dst = self.check(offset, src.len())?;
        // SAFETY: the extent is inside the live mapping; `src` is daemon memory, never part of
        // the mapping (no safe slice of it exists). The owner may write the same pages
        // concurrently (shared memory); a SIGBUS is absorbed by the guard this access holds.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Fills `dst` from the mapping at `offset`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), OutOfRange> {
        let src = self.check(offset, dst.len())?;
        // SAFETY: as in `write`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}
