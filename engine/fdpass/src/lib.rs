//! kvnode-fdpass: SCM_RIGHTS descriptor passing and SO_PEERCRED on Unix sockets.
//!
//! Both calls work on any raw socket descriptor, blocking or not (a non-blocking socket
//! returns `WouldBlock` like any read or write).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors accepted in one message.
pub const MAX_FDS_PER_MSG: usize = 8;

/// recvmsg into `dst`; descriptors that arrive are appended to `fds` while it holds fewer
/// than `keep` (the rest are closed, so a peer cannot exhaust our descriptor table).
pub fn recv_with_fds(
    sock: RawFd,
    dst: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
    keep: usize,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS_PER_MSG * size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = [0u64; 16];
    debug_assert!(space <= size_of_val(&cbuf));
    // SAFETY: a zeroed msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: walking the control buffer the kernel filled, with the libc CMSG macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                #[expect(clippy::cast_ptr_alignment, reason = "read with read_unaligned")]
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                    if fds.len() < keep {
                        fds.push_back(fd);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    Ok(n as usize)
}

/// sendmsg of `bytes` with `fd` attached; returns bytes sent (maybe fewer than all).
pub fn send_with_fd(sock: RawFd, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = [0u64; 4];
    // SAFETY: a zeroed msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: filling the single control message we reserved room for.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&raw const msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
        libc::CMSG_DATA(c)
            .cast::<RawFd>()
            .write_unaligned(fd.as_raw_fd());
    }
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &raw const msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Asks for `bytes` of socket send and receive buffer (the kernel caps it at
/// `net.core.wmem_max`/`rmem_max`). Larger buffers mean fewer wake-ups per MiB moved.
pub fn set_buffers(sock: RawFd, bytes: usize) {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt reads one c_int. Failure only leaves the default size.
        unsafe {
            libc::setsockopt(
                sock,
                libc::SOL_SOCKET,
                opt,
                (&raw const v).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// Credentials of the process at the other end of a Unix socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerCred {
    /// Peer pid.
    pub pid: i32,
    /// Peer uid.
    pub uid: u32,
    /// Peer gid.
    pub gid: u32,
}

/// SO_PEERCRED of a connected Unix socket.
pub fn peer_cred(sock: RawFd) -> io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `c`.
    let rc = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &raw mut len,
        )
    };
    if rc == 0 {
        Ok(PeerCred {
            pid: c.pid,
            uid: c.uid,
            gid: c.gid,
        })
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn descriptor_and_bytes_arrive_together_and_extras_are_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let fd = unsafe { BorrowedFd::borrow_raw(file.as_raw_fd()) };
        assert_eq!(send_with_fd(a.as_raw_fd(), b"hi", fd).unwrap(), 2);
        assert_eq!(send_with_fd(a.as_raw_fd(), b"yo", fd).unwrap(), 2);
        let mut q = VecDeque::new();
        let mut buf = [0u8; 2];
        assert_eq!(
            recv_with_fds(b.as_raw_fd(), &mut buf, &mut q, 1).unwrap(),
            2
        );
        assert_eq!(&buf, b"hi");
        assert_eq!(
            recv_with_fds(b.as_raw_fd(), &mut buf, &mut q, 1).unwrap(),
            2
        );
        assert_eq!(q.len(), 1, "second descriptor must be dropped at the cap");
        let cred = peer_cred(b.as_raw_fd()).unwrap();
        assert_eq!(u32::try_from(cred.pid).unwrap(), std::process::id());
    }
}
