//! The client's mapping of the daemon's arena.

use std::os::fd::{AsRawFd, OwnedFd};

use kvnode_proto::client::Extent;

/// A shared, read-write mapping of the daemon's arena memfd.
#[derive(Debug)]
pub struct ArenaMap {
    base: *mut u8,
    len: u64,
    _fd: OwnedFd,
}

// SAFETY: plain shared memory; access discipline (leases, reservations) is the protocol's.
unsafe impl Send for ArenaMap {}

impl ArenaMap {
    pub(crate) fn map(fd: &OwnedFd, len: u64) -> std::io::Result<Self> {
        // SAFETY: mapping a memfd of `len` bytes received from the daemon.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            base: base.cast(),
            len,
            _fd: fd.try_clone()?,
        })
    }

    /// Arena size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, e: Extent) {
        assert!(
            e.offset
                .checked_add(e.len)
                .is_some_and(|end| end <= self.len),
            "extent {e:?} outside the arena"
        );
    }

    /// The bytes of a leased extent. Valid until the lease is released.
    pub fn read(&self, e: Extent) -> &[u8] {
        self.check(e);
        // SAFETY: in bounds; a leased block is immutable until released.
        unsafe { std::slice::from_raw_parts(self.base.add(e.offset as usize), e.len as usize) }
    }

    /// The bytes of a granted (reserved) extent, to fill before commit.
    #[expect(
        clippy::mut_from_ref,
        reason = "the arena is shared memory; exclusivity comes from the reservation"
    )]
    pub fn write(&self, e: Extent) -> &mut [u8] {
        self.check(e);
        // SAFETY: in bounds; a reserved slot belongs to this connection until commit/abort.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(e.offset as usize), e.len as usize) }
    }
}

impl ArenaMap {
    /// Registers this mapping with CUDA in the calling thread's current context (device 0's
    /// primary context if none is current), page-locked and portable, in `piece`-byte pieces
    /// (use the daemon's `gpu.register_piece_bytes` so no slot straddles two pieces). GPU copies
    /// to and from arena extents then run at pinned speed. Unregistered when the value drops;
    /// keep it alive no longer than this mapping.
    pub fn register_cuda(
        &self,
        piece: u64,
    ) -> Result<kvnode_gpu::register::HostRegistration, kvnode_gpu::GpuError> {
        let stop = std::sync::atomic::AtomicBool::new(false);
        // SAFETY: the range is this mapping; the caller drops the registration before it.
        unsafe {
            kvnode_gpu::register::HostRegistration::register(
                self.base,
                self.len,
                piece,
                &stop,
                |_| {},
            )
        }
        .map_err(|(_, e)| e)
    }
}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len as usize) };
    }
}
