//! The shared-memory arena: one memfd, mapped shared, that clients map too.
//!
//! Creation is instant whatever the size (memfd + ftruncate + mmap); faulting pages in and
//! locking them happens on a background thread ([`pin`]) so start-up never waits for it.
//!
//! The mapping is a `memmap2::MmapRaw`: `MAP_SHARED`, read-write, over the memfd (a `File`),
//! which is every flag the arena uses. What memmap2 does not do stays raw libc, on purpose:
//! - `memfd_create` (with `MFD_HUGETLB | MFD_HUGE_2MB` for hugetlb), `ftruncate` and the
//!   seals (`F_SEAL_SHRINK | F_SEAL_GROW`: clients hold the descriptor read-write and must
//!   not resize the arena under the daemon's mapping): memmap2 maps files, it does not create
//!   or seal them. A hugetlb memfd makes the shared mapping hugetlb by
//!   itself; memmap2's `huge()` (`MAP_HUGETLB`) only applies to anonymous maps and is not used.
//! - `MAP_POPULATE` (memmap2's `populate()`) is not used: it would fault the whole arena in
//!   inside `mmap`, and start-up must not wait for that; [`pin`] does it chunk by chunk.
//! - `MADV_HUGEPAGE` goes through memmap2's `advise(Advice::HugePage)`.

mod adopt;
mod pin;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::{Advice, MmapOptions, MmapRaw};

pub use pin::PinOptions;

const HUGE_2MB: u64 = 2 << 20;

/// Arena creation failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArenaError {
    /// memfd_create failed.
    #[error("memfd_create failed: {0}{hint}", hint = if *.1 { " (hugetlb requested: reserve pages in /proc/sys/vm/nr_hugepages or set hugetlb = false)" } else { "" })]
    Memfd(std::io::Error, bool),
    /// ftruncate failed.
    #[error("cannot size the arena to {1} bytes: {0}")]
    Truncate(std::io::Error, u64),
    /// Sealing the memfd against resizing failed.
    #[error("cannot seal the arena memfd against resizing: {0}")]
    Seal(std::io::Error),
    /// mmap failed.
    #[error("cannot map the arena ({1} bytes): {0}")]
    Map(std::io::Error, u64),
}

/// Progress of background population and pinning.
#[derive(Debug, Default)]
pub struct PinProgress {
    /// Bytes faulted in.
    pub populated: AtomicU64,
    /// Bytes locked with mlock.
    pub pinned: AtomicU64,
    /// mlock was refused; the arena runs unpinned.
    pub refused: AtomicBool,
    /// The background pass finished.
    pub done: AtomicBool,
}

/// The arena mapping. Bytes are shared with client processes: Rust's aliasing rules cannot
/// describe another process's writes, so slices are handed out only under a lease (see
/// [`crate::dram`]) and only for the lease's extent.
#[derive(Debug)]
pub struct Arena {
    /// The memfd, kept open for passing to clients. Declared before `map`, but the order does
    /// not matter: a mapping outlives the descriptor it was made from.
    fd: File,
    /// Send + Sync (memmap2's promise for a raw map): the bytes are plain shared memory and
    /// concurrent access is coordinated by the tier's leases (a slot is written only while
    /// reserved by one writer and read only once committed).
    map: MmapRaw,
    len: u64,
    progress: Arc<PinProgress>,
}

impl Arena {
    /// Creates and maps an arena of `len` bytes (rounded up to 2 MiB with hugetlb).
    pub fn create(len: u64, hugetlb: bool) -> Result<Self, ArenaError> {
        let len = if hugetlb {
            len.div_ceil(HUGE_2MB) * HUGE_2MB
        } else {
            len
        };
        let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        if hugetlb {
            flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
        }
        // SAFETY: the name is a valid NUL-terminated string.
        let raw = unsafe { libc::memfd_create(c"kvnode-arena".as_ptr(), flags) };
        if raw < 0 {
            return Err(ArenaError::Memfd(std::io::Error::last_os_error(), hugetlb));
        }
        // SAFETY: raw is a fresh, owned descriptor.
        let fd = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        fd.set_len(len).map_err(|e| ArenaError::Truncate(e, len))?;
        // Clients get this descriptor read-write: the seals stop one from shrinking the arena
        // under the daemon's mapping (a SIGBUS in the daemon) or growing it.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a valid descriptor.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(ArenaError::Seal(std::io::Error::last_os_error()));
        }
        let bytes = usize::try_from(len)
            .map_err(|_| ArenaError::Map(std::io::ErrorKind::InvalidInput.into(), len))?;
        let map = MmapOptions::new()
            .len(bytes)
            .map_raw(&fd)
            .map_err(|e| ArenaError::Map(e, len))?;
        if !hugetlb {
            // Advice only (errors ignored): shmem THP depends on
            // /sys/kernel/mm/transparent_hugepage/shmem_enabled.
            let _ = map.advise(Advice::HugePage);
        }
        Ok(Self {
            fd,
            map,
            len,
            progress: Arc::new(PinProgress::default()),
        })
    }

    /// Arena size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the arena is empty (never, once created).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to pass to clients.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Background pinning progress.
    pub fn progress(&self) -> &Arc<PinProgress> {
        &self.progress
    }

    /// Bytes `[offset, offset + len)` for reading.
    ///
    /// # Safety
    /// The caller holds a lease or reservation covering the extent, and nothing writes it
    /// for the lifetime of the slice.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "extent outside arena"
        );
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe {
            std::slice::from_raw_parts(self.map.as_mut_ptr().add(offset as usize), len as usize)
        }
    }

    /// Bytes `[offset, offset + len)` for writing.
    ///
    /// # Safety
    /// The caller holds the reservation of the extent and no one else accesses it.
    #[expect(
        clippy::mut_from_ref,
        reason = "the arena is shared memory; exclusivity comes from reservations"
    )]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "extent outside arena"
        );
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset as usize), len as usize)
        }
    }

    /// Starts populating and pinning on a background thread; it stops early when `stop` is set.
    pub fn start_pinning(
        self: &Arc<Self>,
        opts: PinOptions,
        stop: Arc<AtomicBool>,
    ) -> Option<std::thread::JoinHandle<()>> {
        if !opts.pin && !opts.populate {
            self.progress.done.store(true, Ordering::Relaxed);
            return None;
        }
        let arena = Arc::clone(self);
        Some(
            std::thread::Builder::new()
                .name("kvnode-pin".into())
                .spawn(move || pin::run(&arena, opts, &stop))
                .expect("spawn pinning thread"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_gib_arena_is_created_instantly_and_pins_in_background() {
        let t = std::time::Instant::now();
        let a = Arc::new(Arena::create(16 << 30, false).unwrap());
        assert!(
            t.elapsed().as_millis() < 500,
            "creation took {:?}",
            t.elapsed()
        );
        // Only exercise pinning on a small arena in unit tests.
        let small = Arc::new(Arena::create(8 << 20, false).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let h = small.start_pinning(
            PinOptions {
                pin: true,
                populate: true,
                chunk: 1 << 20,
            },
            stop,
        );
        h.unwrap().join().unwrap();
        let p = small.progress();
        assert!(p.done.load(Ordering::Relaxed));
        assert_eq!(p.populated.load(Ordering::Relaxed), 8 << 20);
        assert!(p.refused.load(Ordering::Relaxed) || p.pinned.load(Ordering::Relaxed) == 8 << 20);
        drop(a);
    }

    #[test]
    fn hugetlb_arena_is_rounded_to_2mib_and_shared_or_refused_with_a_typed_error() {
        // With pages reserved (vm.nr_hugepages) the mapping works; without, mapping a hugetlb
        // memfd fails at mmap (ENOMEM) and must come back as ArenaError::Map, not a panic.
        match Arena::create(3 << 20, true) {
            Ok(a) => {
                assert_eq!(a.len(), 4 << 20);
                // SAFETY: test owns the whole arena.
                unsafe { a.slice_mut((4 << 20) - 4, 4) }.copy_from_slice(b"huge");
                let mut buf = [0u8; 4];
                // SAFETY: pread into a local buffer from a valid fd.
                let n = unsafe {
                    libc::pread(
                        a.fd().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        4,
                        (4 << 20) - 4,
                    )
                };
                assert_eq!((n, &buf), (4, b"huge"));
            }
            Err(e) => assert!(
                matches!(
                    e,
                    ArenaError::Map(_, 4_194_304) | ArenaError::Memfd(_, true)
                ),
                "{e}"
            ),
        }
    }

    #[test]
    fn a_client_holding_the_fd_cannot_resize_the_arena() {
        let a = Arena::create(8 << 20, false).unwrap();
        // What a client receives over SCM_RIGHTS: the same open file, read-write.
        let client = File::from(a.fd().try_clone_to_owned().unwrap());
        for size in [0, 4 << 20, 16 << 20] {
            let e = client.set_len(size).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "set_len({size}): {e}");
        }
        assert_eq!(client.metadata().unwrap().len(), 8 << 20);
    }

    #[test]
    fn writes_through_one_mapping_are_seen_through_the_fd() {
        let a = Arena::create(8 << 20, false).unwrap();
        // SAFETY: test owns the whole arena.
        unsafe { a.slice_mut(4096, 4) }.copy_from_slice(b"kvnd");
        let mut buf = [0u8; 4];
        // SAFETY: pread into a local buffer from a valid fd.
        let n = unsafe { libc::pread(a.fd().as_raw_fd(), buf.as_mut_ptr().cast(), 4, 4096) };
        assert_eq!(n, 4);
        assert_eq!(&buf, b"kvnd");
    }
}
