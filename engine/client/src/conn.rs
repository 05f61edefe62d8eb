//! Blocking framed connection: requests out, replies (and payloads) in.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use kvnode_proto::client::{GetMode, Op, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, decode_header, encode_frame};
use kvnode_proto::{Key, PROTOCOL_VERSION};

use crate::{ClientError, Result, unexpected};

#[derive(Debug)]
pub(crate) struct Conn {
    sock: UnixStream,
    next_id: u64,
    header: Vec<u8>,
}

fn write_all_vectored(sock: &mut UnixStream, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        let n = sock.write_vectored(bufs)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

impl Conn {
    pub fn connect(path: &Path, name: &str) -> Result<(Self, Reply, Option<OwnedFd>)> {
        Self::connect_within(path, name, None)
    }

    /// [`Conn::connect`], waiting at most `limit` for the daemon's answer to the handshake.
    pub fn connect_within(
        path: &Path,
        name: &str,
        limit: Option<std::time::Duration>,
    ) -> Result<(Self, Reply, Option<OwnedFd>)> {
        let sock = UnixStream::connect(path)?;
        sock.set_read_timeout(limit)?;
        kvnode_fdpass::set_buffers(sock.as_raw_fd(), 4 << 20);
        let mut c = Self {
            sock,
            next_id: 1,
            header: Vec::new(),
        };
        let req = Request {
            id: 0,
            op: Op::Hello {
                version: PROTOCOL_VERSION,
                client: name.into(),
            },
        };
        let frame = encode_frame(&req, 0).map_err(|e| ClientError::Protocol(e.to_string()))?;
        c.sock.write_all(&frame)?;
        // The reply's first bytes carry the descriptor: read them with recvmsg.
        let mut fds = VecDeque::new();
        let mut prefix = [0u8; PREFIX_LEN];
        let mut got = 0;
        while got < PREFIX_LEN {
            let n =
                kvnode_fdpass::recv_with_fds(c.sock.as_raw_fd(), &mut prefix[got..], &mut fds, 1)?;
            if n == 0 {
                return Err(ClientError::Protocol(
                    "daemon closed during handshake".into(),
                ));
            }
            got += n;
        }
        let p = FramePrefix::decode(prefix).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let reply = c.read_header(p)?;
        c.sock.set_read_timeout(None)?;
        Ok((c, reply.reply, fds.pop_front()))
    }

    fn read_header(&mut self, p: FramePrefix) -> Result<Response> {
        self.header.resize(p.header_len as usize, 0);
        self.sock.read_exact(&mut self.header)?;
        decode_header(&self.header).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    fn send(&mut self, op: Op, payload: &[&[u8]]) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let total: u64 = payload.iter().map(|p| p.len() as u64).sum();
        let frame = encode_frame(&Request { id, op }, total)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(payload.len() + 1);
        slices.push(IoSlice::new(&frame));
        slices.extend(payload.iter().map(|p| IoSlice::new(p)));
        write_all_vectored(&mut self.sock, &mut slices)?;
        Ok(id)
    }

    fn recv(&mut self, id: u64) -> Result<(Reply, u32)> {
        let mut prefix = [0u8; PREFIX_LEN];
        self.sock.read_exact(&mut prefix)?;
        let p = FramePrefix::decode(prefix).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let r = self.read_header(p)?;
        if r.id != id && !matches!(r.reply, Reply::Error { .. }) {
            return Err(ClientError::Protocol(format!(
                "reply id {} for request {id}",
                r.id
            )));
        }
        Ok((r.reply, p.payload_len))
    }

    pub fn call(&mut self, op: Op, payload: &[&[u8]]) -> Result<Reply> {
        let id = self.send(op, payload)?;
        let (reply, plen) = self.recv(id)?;
        if plen != 0 {
            return Err(ClientError::Protocol(format!(
                "unexpected {plen}-byte payload"
            )));
        }
        Ok(reply)
    }

    /// A payload-less request whose first byte carries `fd` (SCM_RIGHTS).
    pub fn call_with_fd(&mut self, op: Op, fd: BorrowedFd<'_>) -> Result<Reply> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode_frame(&Request { id, op }, 0)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let sent = kvnode_fdpass::send_with_fd(self.sock.as_raw_fd(), &frame, fd)?;
        self.sock.write_all(&frame[sent..])?;
        let (reply, plen) = self.recv(id)?;
        if plen != 0 {
            return Err(ClientError::Protocol(format!(
                "unexpected {plen}-byte payload"
            )));
        }
        Ok(reply)
    }

    pub fn call_with_payload(&mut self, op: Op) -> Result<(Reply, Vec<u8>)> {
        let id = self.send(op, &[])?;
        let (reply, plen) = self.recv(id)?;
        let mut payload = vec![0u8; plen as usize];
        self.sock.read_exact(&mut payload)?;
        Ok((reply, payload))
    }

    pub fn get_into(
        &mut self,
        ns: u32,
        keys: &[Key],
        dst: &mut [&mut [u8]],
    ) -> Result<Vec<Option<u64>>> {
        if dst.len() != keys.len() {
            return Err(ClientError::Protocol(format!(
                "{} keys but {} buffers",
                keys.len(),
                dst.len()
            )));
        }
        let id = self.send(
            Op::Get {
                ns,
                keys: keys.to_vec(),
                mode: GetMode::Inline,
                hint: None,
                deadline_ms: None,
            },
            &[],
        )?;
        let (reply, plen) = self.recv(id)?;
        let Reply::GetInline { lens, .. } = reply else {
            let mut skip = vec![0u8; plen as usize];
            self.sock.read_exact(&mut skip)?;
            return Err(unexpected(&reply));
        };
        let mut total = 0u64;
        for (l, d) in lens.iter().zip(dst.iter_mut()) {
            if let Some(l) = *l {
                let l = l as usize;
                if l > d.len() {
                    return Err(ClientError::Protocol(format!(
                        "block of {l} bytes exceeds its {}-byte buffer",
                        d.len()
                    )));
                }
                self.sock.read_exact(&mut d[..l])?;
                total += l as u64;
            }
        }
        if total != u64::from(plen) {
            return Err(ClientError::Protocol(
                "payload length disagrees with block lengths".into(),
            ));
        }
        Ok(lens)
    }
}
