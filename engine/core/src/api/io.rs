//! Framed, buffered socket I/O on a tokio Unix stream, with SCM_RIGHTS in both directions.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN};
use tokio::io::Interest;
use tokio::net::UnixStream;

const READ_BUF: usize = 64 << 10;
/// Descriptors a connection may have queued at once (an `AttachRegion` needs one); more
/// arriving with the same bytes are closed on receipt.
const MAX_QUEUED_FDS: usize = 2;
/// Socket buffer size asked for (inline payloads of MiB-sized pages).
const SOCKET_BUF: usize = 4 << 20;
/// Largest frame header accepted before the `Hello` (a `Hello` is a few dozen bytes).
pub const PRE_HELLO_MAX_HEADER: u32 = 4 << 10;

/// A socket with a read buffer and a queue of received descriptors. Until [`SockIo::ready`]
/// (the `Hello` was accepted) it has no read buffer, default socket buffers and a small
/// header limit: a connection that never says `Hello` costs the daemon almost nothing.
#[derive(Debug)]
pub struct SockIo {
    stream: UnixStream,
    buf: Box<[u8]>,
    max_header: u32,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

/// Outcome of reading the next frame.
#[derive(Debug)]
pub enum Incoming {
    /// A frame header (payload not yet read).
    Frame(FramePrefix, Vec<u8>),
    /// The peer closed at a frame boundary.
    Closed,
}

impl SockIo {
    /// Wraps a connected stream.
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            buf: Box::default(),
            max_header: PRE_HELLO_MAX_HEADER,
            start: 0,
            end: 0,
            fds: VecDeque::new(),
        }
    }

    /// The handshake is done: read buffer, large socket buffers, any header size.
    pub fn ready(&mut self) {
        kvnode_fdpass::set_buffers(self.stream.as_raw_fd(), SOCKET_BUF);
        if self.buf.is_empty() {
            self.buf = vec![0u8; READ_BUF].into_boxed_slice();
        }
        self.max_header = u32::MAX;
    }

    /// The underlying stream.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Takes the oldest descriptor received.
    /// Closes every queued descriptor.
    pub fn discard_fds(&mut self) {
        self.fds.clear();
    }

    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    async fn recv_into_buf(&mut self) -> io::Result<usize> {
        let raw = self.stream.as_raw_fd();
        loop {
            self.stream.readable().await?;
            let Self {
                stream, buf, fds, ..
            } = self;
            match stream.try_io(Interest::READABLE, || {
                kvnode_fdpass::recv_with_fds(raw, buf, fds, MAX_QUEUED_FDS)
            }) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    async fn recv_direct(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let raw = self.stream.as_raw_fd();
        loop {
            self.stream.readable().await?;
            let Self { stream, fds, .. } = self;
            match stream.try_io(Interest::READABLE, || {
                kvnode_fdpass::recv_with_fds(raw, dst, fds, MAX_QUEUED_FDS)
            }) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Fills `dst` exactly. Large reads bypass the buffer and land in `dst` directly.
    /// Returns `Ok(false)` if the peer closed before the first byte (only meaningful at a
    /// frame boundary), and an `UnexpectedEof` error if it closed midway.
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> io::Result<bool> {
        let mut got = 0;
        while got < dst.len() {
            if self.start < self.end {
                let n = (self.end - self.start).min(dst.len() - got);
                dst[got..got + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                got += n;
                continue;
            }
            let want = dst.len() - got;
            // Without a buffer (before the handshake) every read lands in `dst`.
            let direct = want >= self.buf.len() / 2;
            let n = if direct {
                self.recv_direct(&mut dst[got..]).await?
            } else {
                let n = self.recv_into_buf().await?;
                self.start = 0;
                self.end = n;
                n
            };
            if n == 0 {
                if got == 0 {
                    return Ok(false);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed mid-frame",
                ));
            }
            if direct {
                got += n;
            }
        }
        Ok(true)
    }

    /// Reads and discards `n` bytes.
    pub async fn skip(&mut self, mut n: u64) -> io::Result<()> {
        let mut scratch = vec![0u8; READ_BUF.min(n as usize)];
        while n > 0 {
            let k = (n as usize).min(scratch.len());
            if !self.read_exact(&mut scratch[..k]).await? {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed mid-frame",
                ));
            }
            n -= k as u64;
        }
        Ok(())
    }

    /// Reads the next frame's prefix and header. A bad prefix is returned as an error of
    /// kind `InvalidData` carrying the frame error text.
    pub async fn read_frame(&mut self) -> io::Result<Incoming> {
        let mut p = [0u8; PREFIX_LEN];
        if !self.read_exact(&mut p).await? {
            return Ok(Incoming::Closed);
        }
        let prefix =
            FramePrefix::decode(p).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if prefix.header_len > self.max_header {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a {}-byte header before Hello; at most {} bytes until the handshake",
                    prefix.header_len, self.max_header
                ),
            ));
        }
        let mut header = vec![0u8; prefix.header_len as usize];
        if !self.read_exact(&mut header).await? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed mid-frame",
            ));
        }
        Ok(Incoming::Frame(prefix, header))
    }

    /// Writes every byte of `bufs`, in order.
    pub async fn write_all(&mut self, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        let mut bufs = bufs;
        let mut left: usize = bufs.iter().map(|b| b.len()).sum();
        while left > 0 {
            self.stream.writable().await?;
            match self.stream.try_write_vectored(bufs) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    left -= n;
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes `bytes` with `fd` attached to the first byte.
    pub async fn write_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        let raw = self.stream.as_raw_fd();
        let sent = loop {
            self.stream.writable().await?;
            match self.stream.try_io(Interest::WRITABLE, || {
                kvnode_fdpass::send_with_fd(raw, bytes, fd)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        };
        self.write_all(&mut [IoSlice::new(&bytes[sent..])]).await
    }
}
