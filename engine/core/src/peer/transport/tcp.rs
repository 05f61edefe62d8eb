//! The TCP transport's async side: dialling, handshakes and the source's sends.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::time::Duration;

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{PeerMsg, check_prefix, decode_peer};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{Frame, TcpPull, bounded};
use crate::peer::PeerError;

/// Read buffer for frame headers (no block body is read on this side).
const HEADER_BUF: usize = 16 << 10;

/// One peer connection over TCP driven by the runtime (Nagle off: answers are
/// latency-bound): both ends' handshakes and everything the source sends.
#[derive(Debug)]
pub struct TcpConn {
    io: BufReader<TcpStream>,
    addr: SocketAddr,
    header: Vec<u8>,
}

impl TcpConn {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        let addr = stream.peer_addr()?;
        Ok(Self {
            io: BufReader::with_capacity(HEADER_BUF, stream),
            addr,
            header: Vec::new(),
        })
    }
}

impl TcpConn {
    /// The remote address (loopback checks of keyless peers).
    pub fn remote(&self) -> SocketAddr {
        self.addr
    }

    /// The destination's end after its handshake, as a blocking [`TcpPull`] (bytes already
    /// buffered go with it).
    pub fn into_pull(self) -> io::Result<TcpPull> {
        let pending = self.io.buffer().to_vec();
        TcpPull::new(self.io.into_inner().into_std()?, &pending)
    }

    /// Sends one frame: `msg`, then `payload` (non-empty only for `Block`), in one `writev`
    /// of prefix + header + payload (repeated only for a short write). A peer that stops
    /// reading costs at most `limit` without progress: then this fails (and the caller
    /// drops the connection and whatever it held for it).
    pub async fn send(
        &mut self,
        msg: &PeerMsg,
        payload: &[u8],
        limit: Duration,
    ) -> Result<(), PeerError> {
        let f = encode_frame(msg, payload.len() as u64)
            .map_err(|e| PeerError::Protocol(e.to_string()))?;
        let mut bufs = [IoSlice::new(&f), IoSlice::new(payload)];
        let mut bufs: &mut [IoSlice<'_>] = &mut bufs;
        let s = self.io.get_mut();
        while !bufs.is_empty() {
            let n = bounded(limit, "peer send", s.write_vectored(bufs)).await?;
            if n == 0 {
                return Err(PeerError::Io(io::ErrorKind::WriteZero.into()));
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        Ok(())
    }

    /// Receives the next frame header within `limit`.
    pub async fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        let mut p = [0u8; PREFIX_LEN];
        bounded(limit, "peer answer", self.io.read_exact(&mut p)).await?;
        let prefix = FramePrefix::decode(p)
            .map_err(|e| PeerError::Frame(e.into()))
            .and_then(|p| check_prefix(p).map_err(PeerError::Frame))?;
        self.header.resize(prefix.header_len as usize, 0);
        let Self { io, header, .. } = self;
        bounded(limit, "peer frame header", io.read_exact(header)).await?;
        let msg = decode_peer(prefix, &self.header).map_err(PeerError::Frame)?;
        Ok((msg, prefix.payload_len))
    }
}
