//! The TCP transport's async side: dialling, handshakes and the source's sends.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::time::Duration;

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{AEAD_TAG_LEN, PeerFrameError, PeerMsg, check_prefix, decode_peer};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::channel::Channel;
use super::{Frame, TcpPull, bounded};
use crate::peer::PeerError;
use crate::peer::error::{HandshakeError, Stage, Verbatim, WireError};

/// Read buffer for frame headers (no block body is read on this side).
const HEADER_BUF: usize = 16 << 10;

/// One peer connection over TCP driven by the runtime (Nagle off: answers are
/// latency-bound): both ends' handshakes and everything the source sends. Plain until the
/// handshake hands it its [`Channel`]; every frame after that is sealed.
#[derive(Debug)]
pub struct TcpConn {
    io: BufReader<TcpStream>,
    addr: SocketAddr,
    local: SocketAddr,
    header: Vec<u8>,
    chan: Option<Channel>,
    /// Encrypted copy of a block body (encrypted sessions only).
    scratch: Vec<u8>,
}

impl TcpConn {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        let addr = stream.peer_addr()?;
        let local = stream.local_addr()?;
        Ok(Self {
            io: BufReader::with_capacity(HEADER_BUF, stream),
            addr,
            local,
            header: Vec::new(),
            chan: None,
            scratch: Vec::new(),
        })
    }

    /// The remote address (loopback checks of keyless peers).
    pub fn remote(&self) -> SocketAddr {
        self.addr
    }

    /// This end's address (which of this host's addresses the peer reached).
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// The session's block MAC (keyed plaintext sessions on a CPU that computes it fast).
    pub fn block_mac(&self) -> Option<&std::sync::Arc<kvnode_blockmac::BlockMac>> {
        self.chan.as_ref().and_then(|c| c.block_mac.as_ref())
    }

    /// Seals every later frame (both directions) with the session's keys.
    pub fn secure(&mut self, chan: Channel) {
        self.chan = Some(chan);
    }

    /// Id of the cluster key the session uses (`None`: keyless or not yet authenticated).
    pub fn key_id(&self) -> Option<u64> {
        self.chan.as_ref().and_then(|c| c.key_id)
    }

    /// Whether the session encrypts.
    pub fn encrypted(&self) -> bool {
        self.chan.as_ref().is_some_and(|c| c.send.encrypts())
    }

    /// The destination's end after its handshake, as a blocking [`TcpPull`] (bytes already
    /// buffered and the session go with it).
    pub fn into_pull(self) -> io::Result<TcpPull> {
        let pending = self.io.buffer().to_vec();
        let chan = self.chan.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotConnected,
                "peer connection not authenticated",
            )
        })?;
        TcpPull::new(self.io.into_inner().into_std()?, &pending, chan)
    }

    /// Sends one frame: `msg`, then `payload` (non-empty only for `Block`), in one `writev`
    /// of prefix + header (+ tag) + payload (repeated only for a short write). In an
    /// encrypted session the payload is encrypted into a scratch copy first and its tag
    /// goes in the header. A peer that stops reading costs at most `limit` without
    /// progress: then this fails (and the caller drops the connection and whatever it held
    /// for it).
    pub async fn send(
        &mut self,
        msg: &PeerMsg,
        payload: &[u8],
        limit: Duration,
    ) -> Result<(), PeerError> {
        self.send_then(msg, payload, None, limit).await
    }

    /// [`TcpConn::send`], with `then` (a payload-less frame, sealed next) in the same
    /// `writev`: a request's last answer and its `Done` leave in one syscall and reach the
    /// destination together.
    pub async fn send_then(
        &mut self,
        msg: &PeerMsg,
        payload: &[u8],
        then: Option<&PeerMsg>,
        limit: Duration,
    ) -> Result<(), PeerError> {
        let len = payload.len() as u64;
        let (f, body): (Vec<u8>, &[u8]) = match &mut self.chan {
            None => (encode_frame(msg, len).map_err(WireError::Encode)?, payload),
            Some(c) if c.send.encrypts() && !payload.is_empty() => {
                self.scratch.clear();
                self.scratch.extend_from_slice(payload);
                let tag = c.send.seal_body(&mut self.scratch);
                let mut m = msg.clone();
                if let (PeerMsg::Block { seal, .. }, Some(t)) = (&mut m, tag) {
                    *seal = t.to_vec();
                }
                (c.send.seal(&m, len)?, &self.scratch)
            }
            Some(c) => (c.send.seal(msg, len)?, payload),
        };
        let trailer = match (then, &mut self.chan) {
            (None, _) => Vec::new(),
            (Some(t), None) => encode_frame(t, 0).map_err(WireError::Encode)?,
            (Some(t), Some(c)) => c.send.seal(t, 0)?,
        };
        let mut bufs = [IoSlice::new(&f), IoSlice::new(body), IoSlice::new(&trailer)];
        let mut bufs: &mut [IoSlice<'_>] = &mut bufs;
        let s = self.io.get_mut();
        while !bufs.is_empty() {
            let n = bounded(limit, Stage::Send, s.write_vectored(bufs)).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero).into());
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        Ok(())
    }

    /// Tests: sends a sealed `msg` announcing all of `payload` but only its first `upto`
    /// bytes (a source that stalls mid-block).
    #[cfg(test)]
    pub async fn send_cut(
        &mut self,
        msg: &PeerMsg,
        payload: &[u8],
        upto: usize,
    ) -> Result<(), PeerError> {
        let c = self.chan.as_mut().expect("a sealed connection");
        let mut f = c.send.seal(msg, payload.len() as u64)?;
        f.extend_from_slice(&payload[..upto]);
        self.io.get_mut().write_all(&f).await?;
        Ok(())
    }

    async fn read_head(
        &mut self,
        limit: Duration,
    ) -> Result<([u8; PREFIX_LEN], FramePrefix), PeerError> {
        let mut p = [0u8; PREFIX_LEN];
        bounded(limit, Stage::Answer, self.io.read_exact(&mut p)).await?;
        let prefix = FramePrefix::decode(p)
            .map_err(|e| PeerError::from(PeerFrameError::from(e)))
            .and_then(|p| check_prefix(p).map_err(PeerError::from))?;
        self.header.resize(prefix.header_len as usize, 0);
        let Self { io, header, .. } = self;
        bounded(limit, Stage::FrameHeader, io.read_exact(header)).await?;
        Ok((p, prefix))
    }

    async fn open(&mut self, p: [u8; PREFIX_LEN], limit: Duration) -> Result<PeerMsg, PeerError> {
        let n = self.chan.as_ref().map_or(0, |c| c.recv.tag_len());
        let mut tag = [0u8; AEAD_TAG_LEN];
        let tag = &mut tag[..n];
        bounded(limit, Stage::FrameTag, self.io.read_exact(tag)).await?;
        let c = self.chan.as_mut().ok_or(WireError::Unsealed)?;
        Ok(c.recv.open(&p, &mut self.header, tag)?.0)
    }

    /// Receives the next frame header within `limit` (checked and opened when sealed).
    pub async fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        let (p, prefix) = self.read_head(limit).await?;
        let msg = if self.chan.is_some() {
            self.open(p, limit).await?
        } else {
            decode_peer(prefix, &self.header)?
        };
        Ok((msg, prefix.payload_len))
    }

    /// The destination's first frame after its `Auth`: the source's sealed `Ready`, or the
    /// plain `Refused` of a source that did not accept the proof (reported, never trusted).
    pub async fn recv_first_sealed(&mut self, limit: Duration) -> Result<PeerMsg, PeerError> {
        let (p, prefix) = self.read_head(limit).await?;
        if let Ok(PeerMsg::Refused { reason }) = decode_peer(prefix, &self.header) {
            return Err(HandshakeError::Refused(Verbatim(reason)).into());
        }
        self.open(p, limit).await
    }
}
