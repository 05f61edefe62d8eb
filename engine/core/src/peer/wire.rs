//! Framed peer I/O over one TCP stream: headers decoded and checked, payloads read straight
//! into the caller's buffer (an arena slot), and every wait bounded by a timeout.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::time::Duration;

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{PeerMsg, check_prefix, decode_peer};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::PeerError;

/// One peer connection.
#[derive(Debug)]
pub struct PeerWire {
    io: BufReader<TcpStream>,
    /// Remote address.
    pub addr: SocketAddr,
    header: Vec<u8>,
}

/// A received frame: the message and, for `Block`, the unread payload length.
pub type Frame = (PeerMsg, u32);

async fn bounded<T>(
    limit: Duration,
    what: &'static str,
    f: impl Future<Output = io::Result<T>>,
) -> Result<T, PeerError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(PeerError::Io),
        Err(_) => Err(PeerError::Timeout(what, limit)),
    }
}

impl PeerWire {
    /// Wraps a connected stream (Nagle off: answers are latency-bound).
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        let addr = stream.peer_addr()?;
        Ok(Self {
            io: BufReader::with_capacity(64 << 10, stream),
            addr,
            header: Vec::new(),
        })
    }

    /// Sends one frame: `msg` then `payload`.
    pub async fn send(&mut self, msg: &PeerMsg, payload: &[u8]) -> Result<(), PeerError> {
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

    /// Sends several payload-less frames in one write (pipelined requests).
    pub async fn send_all(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        let mut out = Vec::new();
        for m in msgs {
            out.extend(encode_frame(m, 0).map_err(|e| PeerError::Protocol(e.to_string()))?);
        }
        self.io.get_mut().write_all(&out).await?;
        Ok(())
    }

    /// Receives the next frame header within `limit`. A payload, if any, must be consumed
    /// with [`PeerWire::read_payload`] or [`PeerWire::skip`] before the next call.
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

    /// Reads exactly `dst.len()` payload bytes, with no progress gap longer than `limit`.
    pub async fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
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

    /// Reads and discards `n` payload bytes.
    pub async fn skip(&mut self, n: u32, limit: Duration) -> Result<(), PeerError> {
        let mut scratch = vec![0u8; (n as usize).min(1 << 20)];
        let mut left = n as usize;
        while left > 0 {
            let k = left.min(scratch.len());
            self.read_payload(&mut scratch[..k], limit).await?;
            left -= k;
        }
        Ok(())
    }
}
