//! The destination's blocking TCP receiver: frame headers come through a small buffer and are
//! opened by the session, block bodies are received by the kernel straight into the caller's
//! slot.

use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd as _;
use std::time::{Duration, Instant};

use kvnode_proto::frame::PREFIX_LEN;
use kvnode_proto::peer::PeerMsg;

use super::channel::Channel;
use super::{Frame, NoSlots, PullConn};
use crate::peer::PeerError;
use crate::peer::error::{Stage, WireError};

/// Header buffer. Reads of at least half of it bypass it, so a block body is copied by the
/// kernel straight into its slot; at most one buffer's worth of a body is copied twice.
const HEADER_BUF: usize = 16 << 10;

/// One dialled peer connection in blocking mode, owned by the thread pulling a chunk.
#[derive(Debug)]
pub struct TcpPull {
    s: TcpStream,
    addr: SocketAddr,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    header: Vec<u8>,
    tag: Vec<u8>,
    /// The `SO_RCVTIMEO`/`SO_SNDTIMEO` in force (set only when it changes).
    limit: Option<Duration>,
    chan: Box<Channel>,
    /// Sequence number of the last frame received (its body is opened under it).
    last: u64,
    /// Sealed bytes [`PullConn::send_early`] could not hand over without waiting: they go
    /// out first in the next blocking call, so frames stay in their sealed order.
    out: Vec<u8>,
}

impl TcpPull {
    /// Takes over `s` (switched to blocking) with `pending`, bytes already read from it, and
    /// the session `chan` its handshake established.
    pub fn new(s: TcpStream, pending: &[u8], chan: Channel) -> io::Result<Self> {
        s.set_nonblocking(false)?;
        let addr = s.peer_addr()?;
        let mut buf = vec![0u8; HEADER_BUF.max(pending.len())].into_boxed_slice();
        buf[..pending.len()].copy_from_slice(pending);
        Ok(Self {
            s,
            addr,
            buf,
            pos: 0,
            end: pending.len(),
            header: Vec::new(),
            tag: Vec::new(),
            limit: None,
            chan: Box::new(chan),
            last: 0,
            out: Vec::new(),
        })
    }

    /// Sends what [`PullConn::send_early`] left (blocking, within `limit`).
    fn flush_early(&mut self, limit: Duration) -> Result<(), PeerError> {
        if self.out.is_empty() {
            return Ok(());
        }
        self.bound(limit)?;
        let out = std::mem::take(&mut self.out);
        self.s.write_all(&out).map_err(|e| send_error(e, limit))
    }

    fn bound(&mut self, limit: Duration) -> io::Result<()> {
        if self.limit != Some(limit) {
            self.s.set_read_timeout(Some(limit))?;
            self.s.set_write_timeout(Some(limit))?;
            self.limit = Some(limit);
        }
        Ok(())
    }

    /// Fills `dst` from the buffer, then from the socket. Each blocking read returns as soon
    /// as any byte arrives (the kernel wakes this thread directly) and waits at most `limit`
    /// (`SO_RCVTIMEO`), so no gap without progress exceeds `limit`. (`MSG_WAITALL` measured
    /// no faster, and its timeout covers a whole call rather than a gap.) The whole read
    /// must also finish within [`read_budget`] (`limit` plus its length at [`MIN_RATE`]): a
    /// peer trickling a byte at a time, never silent for `limit`, is cut off there. A close
    /// part-way reports `Truncated(bytes got, dst.len())`.
    fn read_exact(
        &mut self,
        dst: &mut [u8],
        limit: Duration,
        stage: Stage,
    ) -> Result<(), PeerError> {
        self.flush_early(limit)?;
        self.bound(limit)?;
        let mut got = (self.end - self.pos).min(dst.len());
        dst[..got].copy_from_slice(&self.buf[self.pos..self.pos + got]);
        self.pos += got;
        let budget = read_budget(limit, dst.len() - got);
        let end = Instant::now() + budget;
        while got < dst.len() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(PeerError::timeout(stage, budget));
            }
            if left < limit {
                self.bound(left)?;
            }
            let rest = &mut dst[got..];
            let n = if rest.len() >= HEADER_BUF / 2 {
                self.s.read(rest)
            } else {
                let n = self.s.read(&mut self.buf);
                if let Ok(n) = n {
                    let k = n.min(rest.len());
                    rest[..k].copy_from_slice(&self.buf[..k]);
                    (self.pos, self.end) = (k, n);
                }
                n.map(|n| n.min(rest.len()))
            };
            match n {
                Ok(0) => {
                    return Err(WireError::Truncated {
                        got,
                        want: dst.len(),
                    }
                    .into());
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => return Err(PeerError::timeout(stage, limit)),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// The slowest a peer may deliver a frame's bytes once it has started: 1 MiB/s, far below
/// any link a pull is worth taking (a 64 KiB block then has 62 ms beyond the io timeout, a
/// 16 MiB one 16 s), and far above a peer that trickles to hold a pull open.
pub const MIN_RATE: u64 = 1 << 20;

/// How long one read of `len` bytes may take in all: `limit` (the longest silence) plus
/// `len` at [`MIN_RATE`].
pub fn read_budget(limit: Duration, len: usize) -> Duration {
    limit + Duration::from_micros(len as u64 * 1_000_000 / MIN_RATE)
}

fn send_error(e: io::Error, limit: Duration) -> PeerError {
    if timed_out(&e) {
        PeerError::timeout(Stage::RequestSend, limit)
    } else {
        e.into()
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Frames that end a connection early are closes, not truncated blocks.
fn frame_eof(e: PeerError) -> PeerError {
    match e {
        PeerError::Wire(WireError::Truncated { .. }) => {
            io::Error::from(io::ErrorKind::UnexpectedEof).into()
        }
        e => e,
    }
}

impl PullConn for TcpPull {
    type Slots = NoSlots;

    /// Seals `msgs` and gives the socket what it takes right now (`MSG_DONTWAIT`): never
    /// waits, so a runtime worker may call it. What the socket did not take is sent first by
    /// the next blocking call. Lets a pull's requests leave before the thread that receives
    /// its answers is even running.
    fn send_early(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        let queued = self.out.len();
        for m in msgs {
            let f = self.chan.send.seal(m, 0)?;
            self.out.extend(f);
        }
        if queued > 0 {
            return Ok(());
        }
        let mut at = 0;
        while at < self.out.len() {
            let rest = &self.out[at..];
            // SAFETY: `rest` is a live buffer of `rest.len()` bytes; the fd is this stream's.
            let n = unsafe {
                libc::send(
                    self.s.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                at += n.unsigned_abs();
                continue;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => break,
                _ => return Err(e.into()),
            }
        }
        self.out.drain(..at);
        Ok(())
    }

    /// The session's block MAC (keyed plaintext sessions on a CPU that computes it fast).
    fn block_mac(&self) -> Option<std::sync::Arc<kvnode_blockmac::BlockMac>> {
        self.chan.block_mac.clone()
    }

    fn slots(&mut self) -> Option<&mut NoSlots> {
        None
    }

    fn remote(&self) -> SocketAddr {
        self.addr
    }

    fn send_all(&mut self, msgs: &[PeerMsg], limit: Duration) -> Result<(), PeerError> {
        // After anything `send_early` left, in sealing order.
        for m in msgs {
            let f = self.chan.send.seal(m, 0)?;
            self.out.extend(f);
        }
        self.flush_early(limit)
    }

    fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        let mut p = [0u8; PREFIX_LEN];
        self.read_exact(&mut p, limit, Stage::Answer)
            .map_err(frame_eof)?;
        let prefix = kvnode_proto::frame::FramePrefix::decode(p)
            .map_err(|e| PeerError::from(kvnode_proto::peer::PeerFrameError::from(e)))
            .and_then(|p| kvnode_proto::peer::check_prefix(p).map_err(PeerError::from))?;
        let mut header = std::mem::take(&mut self.header);
        let mut tag = std::mem::take(&mut self.tag);
        header.resize(prefix.header_len as usize, 0);
        tag.resize(self.chan.recv.tag_len(), 0);
        let r = self
            .read_exact(&mut header, limit, Stage::FrameHeader)
            .and_then(|()| self.read_exact(&mut tag, limit, Stage::FrameTag))
            .map_err(frame_eof)
            .and_then(|()| self.chan.recv.open(&p, &mut header, &tag));
        self.header = header;
        self.tag = tag;
        let (msg, seq) = r?;
        self.last = seq;
        Ok((msg, prefix.payload_len))
    }

    fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
        self.read_exact(dst, limit, Stage::BlockBytes)
    }

    fn key_id(&self) -> Option<u64> {
        self.chan.key_id
    }

    fn open_payload(&mut self, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        self.chan.recv.open_body(self.last, body, seal)
    }

    fn encrypted(&self) -> bool {
        self.chan.recv.encrypts()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Instant;

    use super::*;
    use crate::peer::transport::channel::Side;
    use kvnode_proto::peer::HASH_LEN;

    /// A connected pair: (writer, reader).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// Both ends of a session: the source's half seals what the reader opens.
    fn session() -> (Channel, Channel) {
        (
            Channel::new(b"test", false, Side::Source),
            Channel::new(b"test", false, Side::Destination),
        )
    }

    fn block(src: &mut Channel, len: u32) -> Vec<u8> {
        let msg = PeerMsg::Block {
            req: 7,
            idx: 0,
            len,
            hash: vec![1; HASH_LEN],
            seal: vec![],
            meta: None,
        };
        let mut f = src.send.seal(&msg, u64::from(len)).unwrap();
        f.extend((0..len).map(|i| (i % 251) as u8));
        f
    }

    #[test]
    fn bytes_read_before_the_switch_and_bodies_larger_than_the_buffer_arrive_intact() {
        let (mut w, r) = pair();
        let (mut src, dst) = session();
        let mut wire = block(&mut src, 100 << 10);
        wire.extend(block(&mut src, 3));
        // The first 5 bytes were already buffered by the async side.
        let mut p = TcpPull::new(r, &wire[..5], dst).unwrap();
        let rest = wire[5..].to_vec();
        let t = std::thread::spawn(move || w.write_all(&rest).unwrap());
        let limit = Duration::from_secs(5);
        for len in [100 << 10, 3] {
            let (msg, n) = p.recv(limit).unwrap();
            assert_eq!(n, len);
            assert!(matches!(msg, PeerMsg::Block { req: 7, len: l, .. } if l == len));
            let mut body = vec![0u8; len as usize];
            p.read_payload(&mut body, limit).unwrap();
            assert!(body.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        }
        t.join().unwrap();
    }

    #[test]
    fn a_body_trickled_a_byte_at_a_time_is_cut_off_at_its_budget() {
        let (mut w, r) = pair();
        let (mut src, dst) = session();
        let wire = block(&mut src, 4096);
        let head = wire.len() - 4096;
        w.write_all(&wire[..head]).unwrap();
        let mut p = TcpPull::new(r, &[], dst).unwrap();
        let limit = Duration::from_millis(300);
        p.recv(limit).unwrap();
        // One byte every 100 ms: never silent for `limit`, 410 s for the whole body.
        let body_bytes = wire[head..].to_vec();
        let trickle = std::thread::spawn(move || {
            for b in body_bytes {
                std::thread::sleep(Duration::from_millis(100));
                if w.write_all(&[b]).is_err() {
                    return;
                }
            }
        });
        let mut body = vec![0u8; 4096];
        let t = Instant::now();
        let e = p.read_payload(&mut body, limit).unwrap_err();
        let took = t.elapsed();
        assert!(e.timed_out() == Some(Stage::BlockBytes), "{e}");
        let budget = read_budget(limit, 4096);
        assert!(
            took >= budget && took < budget + limit,
            "budget {budget:?}, cut off after {took:?}"
        );
        drop(p);
        trickle.join().unwrap();
    }

    #[test]
    fn a_stall_mid_body_times_out_after_one_limit_and_a_close_reports_the_bytes_got() {
        let (mut w, r) = pair();
        let (mut src, dst) = session();
        let wire = block(&mut src, 1 << 20);
        let head = wire.len() - (1 << 20);
        w.write_all(&wire[..head + (300 << 10)]).unwrap();
        let mut p = TcpPull::new(r, &[], dst).unwrap();
        let limit = Duration::from_millis(300);
        p.recv(limit).unwrap();
        let mut body = vec![0u8; 1 << 20];
        let t = Instant::now();
        let e = p.read_payload(&mut body, limit).unwrap_err();
        assert!(e.timed_out() == Some(Stage::BlockBytes), "{e}");
        let took = t.elapsed();
        assert!(took >= limit && took < limit * 2, "stall cost {took:?}");
        // 1000 more bytes, then the peer closes inside the next read.
        let mut p = TcpPull::new(p.s, &[], *p.chan).unwrap();
        w.write_all(&wire[head..head + 1000]).unwrap();
        drop(w);
        let e = p.read_payload(&mut body[..4096], limit).unwrap_err();
        assert!(
            matches!(
                e,
                PeerError::Wire(WireError::Truncated {
                    got: 1000,
                    want: 4096
                })
            ),
            "{e}"
        );
    }
}
