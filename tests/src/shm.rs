//! A test-owned memfd mapped into the test, like SGLang's `"allocator": "shm"` host pool.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvnode_client::ClientError;
use kvnode_proto::client::ErrorCode;

/// A memfd of `len` bytes, mapped shared into the test; unmapped on drop.
#[derive(Debug)]
pub struct Shm {
    /// The descriptor (what `attach_region` sends).
    pub fd: OwnedFd,
    base: *mut u8,
    /// Mapped length.
    pub len: usize,
}

impl Shm {
    /// An unsealable memfd (`MFD_CLOEXEC` only), as SGLang 0.5.23 creates its host pool.
    pub fn new(name: &str, len: usize) -> Self {
        Self::with_flags(name, len, libc::MFD_CLOEXEC)
    }

    /// A memfd created with `flags` (e.g. `MFD_ALLOW_SEALING`).
    pub fn with_flags(name: &str, len: usize, flags: libc::c_uint) -> Self {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: valid NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c.as_ptr(), flags) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        assert_eq!(
            unsafe { libc::ftruncate(raw, libc::off_t::try_from(len).unwrap()) },
            0
        );
        // SAFETY: mapping our own memfd of `len` bytes.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        Self {
            fd,
            base: base.cast(),
            len,
        }
    }

    /// The mapped bytes (do not touch them after shrinking the file below them).
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: our own mapping; the daemon only writes it during a request we wait on.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    /// `ftruncate` from the client side; returns whether the kernel allowed it.
    pub fn truncate(&self, len: usize) -> bool {
        // SAFETY: valid descriptor.
        unsafe { libc::ftruncate(self.fd.as_raw_fd(), libc::off_t::try_from(len).unwrap()) == 0 }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Asserts `r` is a server error with `code` whose message contains `needle`.
pub fn refused(r: Result<impl std::fmt::Debug, ClientError>, code: ErrorCode, needle: &str) {
    match r {
        Err(ClientError::Server { code: c, message }) => {
            assert_eq!(c, code, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        other => panic!("expected {code:?} error, got {other:?}"),
    }
}
