//! IO engines behind one enum (enum dispatch): `io_uring`, pread/pwrite, and fault injection.

#[cfg(feature = "fault-injection")]
mod faulty;
mod psync;
mod uring;

#[cfg(feature = "fault-injection")]
pub use faulty::FaultPlan;
#[cfg(feature = "fault-injection")]
pub(crate) use faulty::FaultyEngine;
pub(crate) use psync::PsyncEngine;
pub(crate) use uring::UringEngine;

use std::io;
use std::os::fd::RawFd;

/// Which IO engine a tier uses; see the crate docs for what each needs from the file system.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum IoEngineKind {
    /// `io_uring` with `O_DIRECT` files; arena memory goes through `READ_FIXED/WRITE_FIXED`.
    /// Needs a file system that accepts `O_DIRECT` with 4096-byte alignment (ext4, xfs; not tmpfs).
    #[default]
    Uring,
    /// `pread`/`pwrite` through the page cache, for file systems that refuse `O_DIRECT`.
    Psync,
    /// Fault injection around another engine, for tests (feature `fault-injection`; never
    /// in a release daemon).
    #[cfg(feature = "fault-injection")]
    Faulty {
        /// The engine doing the real IO.
        inner: Box<IoEngineKind>,
        /// Which faults to inject.
        plan: FaultPlan,
    },
}

impl IoEngineKind {
    /// Whether files for this engine are opened with `O_DIRECT` (alignment rules apply).
    pub fn direct(&self) -> bool {
        match self {
            IoEngineKind::Uring => true,
            IoEngineKind::Psync => false,
            #[cfg(feature = "fault-injection")]
            IoEngineKind::Faulty { inner, .. } => inner.direct(),
        }
    }

    /// Whether the engine needs a wake-up eventfd (it waits inside the kernel).
    pub(crate) fn uses_ring(&self) -> bool {
        match self {
            IoEngineKind::Uring => true,
            IoEngineKind::Psync => false,
            #[cfg(feature = "fault-injection")]
            IoEngineKind::Faulty { inner, .. } => inner.uses_ring(),
        }
    }
}

/// One request to the engine. Pointers stay valid until the matching completion is reaped.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sqe {
    Write {
        buf: *const u8,
        len: u32,
        offset: u64,
        fixed: Option<u16>,
    },
    Read {
        buf: *mut u8,
        len: u32,
        offset: u64,
        fixed: Option<u16>,
    },
    Fsync,
}

/// A completion: the token given at push and the result (bytes, or negative errno).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cqe {
    pub token: u64,
    pub res: i32,
}

/// The engine of one IO worker (one file).
#[derive(Debug)]
pub(crate) enum IoEngine {
    Uring(Box<UringEngine>),
    Psync(PsyncEngine),
    #[cfg(feature = "fault-injection")]
    Faulty(Box<FaultyEngine>),
}

impl IoEngine {
    pub fn new(
        kind: &IoEngineKind,
        fd: RawFd,
        entries: u32,
        wake: Option<RawFd>,
    ) -> io::Result<Self> {
        Ok(match kind {
            IoEngineKind::Uring => IoEngine::Uring(Box::new(UringEngine::new(fd, entries, wake)?)),
            IoEngineKind::Psync => IoEngine::Psync(PsyncEngine::new(fd)),
            #[cfg(feature = "fault-injection")]
            IoEngineKind::Faulty { inner, plan } => {
                let inner = IoEngine::new(inner, fd, entries, wake)?;
                #[cfg(feature = "fault-injection")]
                IoEngine::Faulty(Box::new(FaultyEngine::new(
                    inner,
                    plan.clone(),
                    kind.direct(),
                )))
            }
        })
    }

    /// Queues `sqe`; the result arrives from a later [`IoEngine::wait`] with `token`.
    pub fn push(&mut self, token: u64, sqe: Sqe) -> io::Result<()> {
        match self {
            IoEngine::Uring(e) => e.push(token, sqe),
            IoEngine::Psync(e) => {
                e.push(token, sqe);
                Ok(())
            }
            #[cfg(feature = "fault-injection")]
            IoEngine::Faulty(e) => e.push(token, sqe),
        }
    }

    /// Submits queued requests and waits until at least `min` completions (or a wake-up)
    /// arrived; appends completions to `out`.
    pub fn wait(&mut self, min: usize, out: &mut Vec<Cqe>) -> io::Result<()> {
        match self {
            IoEngine::Uring(e) => e.wait(min, out),
            IoEngine::Psync(e) => {
                e.drain(out);
                Ok(())
            }
            #[cfg(feature = "fault-injection")]
            IoEngine::Faulty(e) => e.wait(min, out),
        }
    }

    /// Registers the arena pieces as fixed buffers (`io_uring` only; a no-op elsewhere).
    ///
    /// # Safety
    /// The memory must stay valid until the engine is dropped.
    pub unsafe fn register_buffers(&mut self, iov: &[libc::iovec]) -> io::Result<()> {
        match self {
            // SAFETY: forwarded contract.
            IoEngine::Uring(e) => unsafe { e.register_buffers(iov) },
            IoEngine::Psync(_) => Ok(()),
            // SAFETY: forwarded contract.
            #[cfg(feature = "fault-injection")]
            IoEngine::Faulty(e) => unsafe { e.inner.register_buffers(iov) },
        }
    }
}
