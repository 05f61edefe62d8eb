//! `io_uring` engine: one ring per IO worker, `O_DIRECT` file, arena pieces as fixed buffers.
//!
//! Kernel features used: `IORING_OP_{READ,WRITE}{,_FIXED}`, `IORING_OP_FSYNC` with
//! `IORING_FSYNC_DATASYNC`, `IORING_OP_POLL_ADD` on an eventfd so a submitter can wake a worker
//! blocked in `io_uring_enter`. Buffers and offsets must be 4096-aligned (`O_DIRECT`).

use super::{Cqe, Sqe};
use io_uring::{IoUring, opcode, squeue, types};
use std::io;
use std::os::fd::RawFd;

/// Token reserved for the wake-up poll.
const WAKE: u64 = u64::MAX;

/// A ring and the file it serves.
pub(crate) struct UringEngine {
    ring: IoUring,
    fd: RawFd,
    wake: Option<RawFd>,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
}

impl UringEngine {
    pub fn new(fd: RawFd, entries: u32, wake: Option<RawFd>) -> io::Result<Self> {
        let ring = IoUring::builder()
            .setup_single_issuer()
            .build(entries.next_power_of_two())?;
        let mut e = Self { ring, fd, wake };
        e.arm_wake()?;
        Ok(e)
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        if let Some(w) = self.wake {
            let sqe = opcode::PollAdd::new(types::Fd(w), libc::POLLIN as u32)
                .build()
                .user_data(WAKE);
            self.push_entry(&sqe)?;
        }
        Ok(())
    }

    fn push_entry(&mut self, sqe: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every pointer in the entry is kept valid by the worker until completion.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    pub fn push(&mut self, token: u64, sqe: Sqe) -> io::Result<()> {
        let fd = types::Fd(self.fd);
        let entry = match sqe {
            Sqe::Write {
                buf,
                len,
                offset,
                fixed: Some(i),
            } => opcode::WriteFixed::new(fd, buf, len, i)
                .offset(offset)
                .build(),
            Sqe::Write {
                buf,
                len,
                offset,
                fixed: None,
            } => opcode::Write::new(fd, buf, len).offset(offset).build(),
            Sqe::Read {
                buf,
                len,
                offset,
                fixed: Some(i),
            } => opcode::ReadFixed::new(fd, buf, len, i)
                .offset(offset)
                .build(),
            Sqe::Read {
                buf,
                len,
                offset,
                fixed: None,
            } => opcode::Read::new(fd, buf, len).offset(offset).build(),
            Sqe::Fsync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        self.push_entry(&entry.user_data(token))
    }

    pub fn wait(&mut self, min: usize, out: &mut Vec<Cqe>) -> io::Result<()> {
        let before = out.len();
        let mut woke = false;
        loop {
            let want = usize::from(out.len() - before < min && !woke);
            match self.ring.submit_and_wait(want) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
            let mut rearm = false;
            for c in self.ring.completion() {
                if c.user_data() == WAKE {
                    woke = true;
                    rearm = true;
                } else {
                    out.push(Cqe {
                        token: c.user_data(),
                        res: c.result(),
                    });
                }
            }
            if rearm {
                if let Some(w) = self.wake {
                    let mut v = 0u64;
                    // SAFETY: reads 8 bytes into a local; the eventfd is non-blocking.
                    unsafe { libc::read(w, (&raw mut v).cast(), 8) };
                }
                self.arm_wake()?;
            }
            if out.len() - before >= min || woke {
                return Ok(());
            }
        }
    }

    /// # Safety
    /// The memory must stay valid until the ring is dropped.
    pub unsafe fn register_buffers(&mut self, iov: &[libc::iovec]) -> io::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.ring.submitter().register_buffers(iov) }
    }
}
