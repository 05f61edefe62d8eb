//! `pread`/`pwrite`/`fdatasync` engine: executes each request at push time.

use super::{Cqe, Sqe};
use std::os::fd::RawFd;

/// Synchronous engine for file systems that refuse `O_DIRECT` (e.g. tmpfs).
#[derive(Debug)]
pub(crate) struct PsyncEngine {
    fd: RawFd,
    done: Vec<Cqe>,
}

fn errno() -> i32 {
    -std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl PsyncEngine {
    pub fn new(fd: RawFd) -> Self {
        Self {
            fd,
            done: Vec::new(),
        }
    }

    /// Runs the request now; a short transfer is retried until EOF or error.
    pub fn push(&mut self, token: u64, sqe: Sqe) {
        let res = match sqe {
            Sqe::Write {
                buf, len, offset, ..
            } => self.rw(true, buf.cast_mut(), len, offset),
            Sqe::Read {
                buf, len, offset, ..
            } => self.rw(false, buf, len, offset),
            // SAFETY: plain syscall on an fd this worker owns.
            Sqe::Fsync => match unsafe { libc::fdatasync(self.fd) } {
                0 => 0,
                _ => errno(),
            },
        };
        self.done.push(Cqe { token, res });
    }

    fn rw(&self, write: bool, buf: *mut u8, len: u32, offset: u64) -> i32 {
        let mut done = 0usize;
        while done < len as usize {
            // SAFETY: the worker guarantees buf..buf+len is valid for the request's lifetime.
            let n = unsafe {
                let p = buf.add(done).cast::<libc::c_void>();
                let rest = len as usize - done;
                let off = (offset + done as u64).cast_signed();
                if write {
                    libc::pwrite(self.fd, p, rest, off)
                } else {
                    libc::pread(self.fd, p, rest, off)
                }
            };
            match n {
                0 => break,
                n if n < 0 => {
                    let e = errno();
                    if e == -libc::EINTR {
                        continue;
                    }
                    return e;
                }
                n => done += n as usize,
            }
        }
        i32::try_from(done).unwrap_or(i32::MAX)
    }

    pub fn drain(&mut self, out: &mut Vec<Cqe>) {
        out.append(&mut self.done);
    }
}
