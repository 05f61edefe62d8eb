//! The TCP transport: frames over one stream, payloads read straight into the caller's buffer.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::time::Duration;

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{PeerMsg, check_prefix, decode_peer};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{Frame, PeerConn, bounded};
use crate::peer::PeerError;

/// Read buffer for frame headers. Payload reads at least this large bypass it, so a block
/// is copied by the kernel straight into its slot; at most one buffer's worth is copied twice.
const HEADER_BUF: usize = 16 << 10;

/// One peer connection over TCP (Nagle off: answers are latency-bound).
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

impl PeerConn for TcpConn {
    fn remote(&self) -> SocketAddr {
        self.addr
    }

    /// One `writev` of prefix + header + payload (repeated only for a short write).
    async fn send(&mut self, msg: &PeerMsg, payload: &[u8]) -> Result<(), PeerError> {
        let f = encode_frame(msg, payload.len() as u64)
            .map_err(|e| PeerError::Protocol(e.to_string()))?;
        let mut bufs = [IoSlice::new(&f), IoSlice::new(payload)];
        let mut bufs: &mut [IoSlice<'_>] = &mut bufs;
        let s = self.io.get_mut();
        while !bufs.is_empty() {
            let n = s.write_vectored(bufs).await?;
            if n == 0 {
                return Err(PeerError::Io(io::ErrorKind::WriteZero.into()));
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        Ok(())
    }

    async fn send_all(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        let mut out = Vec::new();
        for m in msgs {
            out.extend(encode_frame(m, 0).map_err(|e| PeerError::Protocol(e.to_string()))?);
        }
        self.io.get_mut().write_all(&out).await?;
        Ok(())
    }

    async fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
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

    async fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
        let mut got = 0;
        while got < dst.len() {
            let n = bounded(limit, "peer block bytes", self.io.read(&mut dst[got..])).await?;
            if n == 0 {
                return Err(PeerError::Truncated(got, dst.len()));
            }
            got += n;
        }
        Ok(())
    }
}
