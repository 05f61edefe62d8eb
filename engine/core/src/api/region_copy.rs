//! A client region's memory and how bytes move to and from it: sealed map, guarded map, pread.
//!
//! Chosen once at attach, logged, and counted in `stats` (`regions`):
//!
//! | mode | when | copy | a client that shrinks its file |
//! |---|---|---|---|
//! | `sealed` | the memfd takes `F_SEAL_SHRINK` (`MFD_ALLOW_SEALING`) | memcpy through the mapping | cannot (the seal refuses `ftruncate`) |
//! | `guarded` | unsealable, and the SIGBUS guard is installed (default) | memcpy through the mapping under `kvnode_shmguard` | the copy faults, is absorbed, the op fails, the region is detached |
//! | `pread` | unsealable and `region_copy = pread`, the file cannot be mapped, or the guard is gone | pread/pwrite on the descriptor | the copy returns an error |

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use kvnode_shmguard::{AccessError, Guarded, OutOfRange, SharedMapping};

use crate::obs::{RegionCounters, RegionMode};

/// How a region's bytes are reached.
#[derive(Debug)]
enum Mode {
    /// Sealed against shrinking: the mapping can never fault, copies need no guard.
    Sealed(SharedMapping),
    /// Unsealable: copies through the mapping inside a SIGBUS-guarded access.
    Guarded(SharedMapping),
    /// pread/pwrite on the descriptor.
    Pread,
}

/// A copy that did not complete; the op fails with this message and nothing is committed.
#[derive(Debug, thiserror::Error)]
pub(super) enum CopyError {
    /// The guarded mapping faulted: the client shrank its file (or its pages ran out).
    #[error("{0}")]
    Faulted(String),
    /// pread/pwrite failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A client's memory attached to one connection.
#[derive(Debug)]
pub struct Region {
    pub(super) len: u64,
    fd: OwnedFd,
    mode: Mode,
    /// Its place under the uid's `regions_per_uid` (given back when the region drops).
    pub(super) charge: Option<crate::tenant::Charge>,
}

fn fd_size(fd: &OwnedFd) -> std::io::Result<(u64, u32, i32)> {
    // SAFETY: a zeroed stat is a valid out-parameter; fd is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_GETFL on a valid descriptor has no side effect.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    Ok((st.st_size as u64, st.st_mode, flags))
}

/// Adds `F_SEAL_SHRINK` (or finds it); false when the file does not allow sealing.
fn seal_shrink(fd: &OwnedFd) -> bool {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a valid descriptor; failure (no MFD_ALLOW_SEALING) is handled.
    let added = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0;
    // SAFETY: as above.
    added || unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } & libc::F_SEAL_SHRINK != 0
}

impl Region {
    /// Validates `fd` (regular file, read-write, at least `len` bytes) and picks the mode.
    /// `guard`: map unsealable files under the SIGBUS guard (config `region_copy = guarded`).
    pub(super) fn attach(fd: OwnedFd, len: u64, guard: bool) -> Result<Self, String> {
        if len == 0 {
            return Err("AttachRegion len must be at least 1 byte".into());
        }
        let (size, mode, flags) =
            fd_size(&fd).map_err(|e| format!("fstat of the descriptor: {e}"))?;
        if mode & libc::S_IFMT != libc::S_IFREG {
            return Err("the descriptor is not a memfd or regular file".into());
        }
        if flags & libc::O_ACCMODE != libc::O_RDWR {
            return Err("the descriptor is not open read-write: open it O_RDWR".into());
        }
        if size < len {
            return Err(format!(
                "the descriptor holds {size} bytes, fewer than the {len} bytes declared"
            ));
        }
        let sealed = seal_shrink(&fd);
        let guard = guard
            && match kvnode_shmguard::install() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot install the SIGBUS guard; unsealable regions copy with pread/pwrite");
                    false
                }
            };
        let map = if sealed || guard {
            let m =
                usize::try_from(len).map_err(|_| format!("len {len} exceeds the address space"));
            match m.and_then(|n| SharedMapping::map(fd.as_fd(), n).map_err(|e| e.to_string())) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot map a client region; copying it with pread/pwrite");
                    None
                }
            }
        } else {
            None
        };
        let mode = match map {
            Some(m) if sealed => Mode::Sealed(m),
            Some(m) => Mode::Guarded(m),
            None => Mode::Pread,
        };
        Ok(Self {
            len,
            fd,
            mode,
            charge: None,
        })
    }

    /// `sealed`, `guarded` or `pread`.
    pub(super) fn mode(&self) -> &'static str {
        match self.mode {
            Mode::Sealed(_) => "sealed",
            Mode::Guarded(_) => "guarded",
            Mode::Pread => "pread",
        }
    }

    /// Counts this attach under its mode.
    pub(super) fn count(&self, c: &RegionCounters) {
        c.attached(match self.mode {
            Mode::Sealed(_) => RegionMode::Sealed,
            Mode::Guarded(_) => RegionMode::Guarded,
            Mode::Pread => RegionMode::Pread,
        });
    }

    /// Copies each `(src, offset)` into the client's memory; all, or an error.
    pub(super) fn write_all(&mut self, copies: &[(&[u8], u64)]) -> Result<(), CopyError> {
        let mapped = |g: &Guarded<'_>| copies.iter().try_for_each(|&(s, o)| g.write(o as usize, s));
        let r = match &self.mode {
            // SAFETY: F_SEAL_SHRINK holds on the file: no page of the mapping can go away.
            Mode::Sealed(m) => Ok(unsafe { m.unguarded(mapped) }),
            Mode::Guarded(m) => m.guarded(mapped),
            Mode::Pread => return self.pwrite_each(copies),
        };
        match self.settle(r) {
            Settled::Done(r) => r,
            Settled::Retry => self.pwrite_each(copies),
        }
    }

    /// Fills each `(dst, offset)` from the client's memory; all, or an error (then the bytes
    /// in `dst` are not the client's and must not be committed).
    pub(super) fn read_all(&mut self, copies: &mut [(&mut [u8], u64)]) -> Result<(), CopyError> {
        let mut mapped = |g: &Guarded<'_>| {
            copies
                .iter_mut()
                .try_for_each(|(d, o)| g.read(*o as usize, d))
        };
        let r = match &self.mode {
            // SAFETY: as in `write_all`.
            Mode::Sealed(m) => Ok(unsafe { m.unguarded(&mut mapped) }),
            Mode::Guarded(m) => m.guarded(&mut mapped),
            Mode::Pread => return self.pread_each(copies),
        };
        match self.settle(r) {
            Settled::Done(r) => r,
            Settled::Retry => self.pread_each(copies),
        }
    }

    /// Turns a mapped access's outcome into the op's; after `Unguarded` (the handler was
    /// replaced since attach, nothing was copied) the region falls back to pread for good.
    fn settle(&mut self, r: Result<Result<(), OutOfRange>, AccessError>) -> Settled {
        match r {
            Ok(Ok(())) => Settled::Done(Ok(())),
            Ok(Err(e)) => Settled::Done(Err(CopyError::Io(std::io::Error::other(e)))),
            Err(AccessError::Faulted) => {
                Settled::Done(Err(CopyError::Faulted(self.fault_reason())))
            }
            Err(_) => {
                tracing::warn!(
                    "the SIGBUS guard is no longer installed (another SIGBUS user replaced it): this region now copies with pread/pwrite"
                );
                self.mode = Mode::Pread;
                Settled::Retry
            }
        }
    }

    /// Why the guarded mapping faulted, for the client's error.
    fn fault_reason(&self) -> String {
        match fd_size(&self.fd) {
            Ok((size, ..)) if size < self.len => format!(
                "the region shrank under the daemon: its file now holds {size} of the {} bytes mapped",
                self.len
            ),
            _ => "the region faulted under the daemon (SIGBUS) although its file is whole: \
                  its pages could not be allocated (full tmpfs or hugetlbfs?)"
                .into(),
        }
    }

    /// Refuses a pread-mode request if the file shrank below `len` (pwrite would grow it
    /// back silently and pread come up short); mapped modes need no check.
    pub(super) fn still_whole(&self) -> Result<(), String> {
        if !matches!(self.mode, Mode::Pread) {
            return Ok(());
        }
        match fd_size(&self.fd) {
            Ok((size, ..)) if size >= self.len => Ok(()),
            Ok((size, ..)) => Err(format!(
                "the region's descriptor shrank to {size} bytes below the {} attached; detach and attach again",
                self.len
            )),
            Err(e) => Err(format!("fstat of the region's descriptor: {e}")),
        }
    }

    fn pwrite_each(&self, copies: &[(&[u8], u64)]) -> Result<(), CopyError> {
        for &(src, off) in copies {
            let (mut buf, mut at) = (src, off);
            while !buf.is_empty() {
                // SAFETY: pwrite from a valid buffer on a valid descriptor.
                let n = unsafe {
                    libc::pwrite(
                        self.fd.as_raw_fd(),
                        buf.as_ptr().cast(),
                        buf.len(),
                        at.cast_signed(),
                    )
                };
                match n {
                    n if n > 0 => {
                        buf = &buf[n as usize..];
                        at += n as u64;
                    }
                    0 => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into()),
                    _ => retry_or(std::io::Error::last_os_error())?,
                }
            }
        }
        Ok(())
    }

    fn pread_each(&self, copies: &mut [(&mut [u8], u64)]) -> Result<(), CopyError> {
        for (dst, off) in copies.iter_mut() {
            let (mut got, len) = (0usize, dst.len());
            while got < len {
                // SAFETY: pread into a valid buffer from a valid descriptor.
                let n = unsafe {
                    libc::pread(
                        self.fd.as_raw_fd(),
                        dst[got..].as_mut_ptr().cast(),
                        len - got,
                        (*off + got as u64).cast_signed(),
                    )
                };
                match n {
                    n if n > 0 => got += n as usize,
                    0 => {
                        return Err(CopyError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the region's file shrank during the copy",
                        )));
                    }
                    _ => retry_or(std::io::Error::last_os_error())?,
                }
            }
        }
        Ok(())
    }
}

enum Settled {
    Done(Result<(), CopyError>),
    Retry,
}

fn retry_or(e: std::io::Error) -> Result<(), CopyError> {
    if e.kind() == std::io::ErrorKind::Interrupted {
        Ok(())
    } else {
        Err(e.into())
    }
}
