//! One client connection: handshake, request loop, and cleanup of everything it holds.

use std::collections::HashMap;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvnode_fdpass::PeerCred;
use kvnode_proto::PROTOCOL_VERSION;
use kvnode_proto::client::{ErrorCode, Op, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, decode_header, encode_frame};
use kvnode_proto::obs::{OpKind, OpStatus};
use tokio::net::UnixStream;
use tokio::sync::watch;

use super::Engine;
use super::io::{Incoming, SockIo};
use crate::obs;
use crate::obs::{ConnWatch, ReplyInfo};
use crate::policy::SlotId;
use crate::tier::Reservation;

fn peer_cred(s: &UnixStream) -> PeerCred {
    kvnode_fdpass::peer_cred(s.as_raw_fd()).unwrap_or_default()
}

/// State owned by one connection.
#[derive(Debug)]
pub(super) struct Connection {
    pub engine: Arc<Engine>,
    pub io: SockIo,
    pub id: u64,
    pub cred: PeerCred,
    /// Lease id -> leased slots.
    pub leases: HashMap<u64, Vec<SlotId>>,
    /// Alloc handle -> reservation.
    pub reservations: HashMap<u64, Reservation>,
    /// Alloc handle -> router metadata given with the alloc.
    pub metas: HashMap<u64, Arc<crate::residency::RouterMeta>>,
    pub next_handle: u64,
    /// Op in flight and lease ages, read by the stall watchdog.
    pub watch: Arc<ConnWatch>,
    /// What the last reply sent said (status, bytes), for the op's probe and histograms.
    reply_info: ReplyInfo,
    /// Region id -> client memory mapped by `AttachRegion` (unmapped on drop).
    pub regions: HashMap<u32, super::region_copy::Region>,
    pub next_region: u32,
    /// Attached GPU buffers and pending onloads.
    pub gpu: super::gpu::GpuConn,
    stop: watch::Receiver<bool>,
}

/// Why a connection ends.
enum End {
    Closed,
    Io(std::io::Error),
    Protocol(String),
}

impl Connection {
    pub fn new(engine: Arc<Engine>, stream: UnixStream, stop: watch::Receiver<bool>) -> Self {
        let cred = peer_cred(&stream);
        let id = engine.next_conn.fetch_add(1, Ordering::Relaxed);
        let watch = engine.metrics.watch.add(id);
        Self {
            engine,
            io: SockIo::new(stream),
            id,
            cred,
            leases: HashMap::new(),
            reservations: HashMap::new(),
            metas: HashMap::new(),
            next_handle: 1,
            watch,
            reply_info: ReplyInfo::default(),
            regions: HashMap::new(),
            next_region: 0,
            gpu: super::gpu::GpuConn::default(),
            stop,
        }
    }

    pub async fn run(mut self) {
        self.engine.clients.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            conn = self.id,
            pid = self.cred.pid,
            uid = self.cred.uid,
            gid = self.cred.gid,
            "client connected"
        );
        let end = match self.handshake().await {
            Ok(()) => self.serve().await,
            Err(e) => e,
        };
        match end {
            End::Closed => tracing::info!(conn = self.id, "client disconnected"),
            End::Io(e) => tracing::info!(conn = self.id, error = %e, "client connection ended"),
            End::Protocol(why) => {
                tracing::warn!(conn = self.id, pid = self.cred.pid, reason = %why, "client dropped");
            }
        }
        self.gpu_cleanup().await;
        self.cleanup();
        self.engine.metrics.watch.remove(self.id);
        self.engine.clients.fetch_sub(1, Ordering::Relaxed);
    }

    /// Releases every lease and reservation this connection still holds.
    fn cleanup(&mut self) {
        // Fence first: ops filling this client's buffers stop before the buffers are freed.
        let back = self.engine.peers.cancel_conn(self.id);
        self.reservations.extend(back);
        let leased: Vec<SlotId> = self.leases.drain().flat_map(|(_, v)| v).collect();
        let reserved: Vec<Reservation> = self.reservations.drain().map(|(_, r)| r).collect();
        self.watch.leases_end();
        if !leased.is_empty() || !reserved.is_empty() {
            tracing::info!(
                conn = self.id,
                leases = leased.len(),
                reservations = reserved.len(),
                "released what the client held"
            );
        }
        self.engine.tier.release(&leased);
        self.engine.tier.abort(self.id, &reserved);
        self.regions.clear();
    }

    async fn handshake(&mut self) -> Result<(), End> {
        let (prefix, header) = match self.io.read_frame().await {
            Ok(Incoming::Frame(p, h)) => (p, h),
            Ok(Incoming::Closed) => return Err(End::Closed),
            Err(e) => return Err(self.fail(0, ErrorCode::Handshake, &e.to_string()).await),
        };
        let req: Request = match decode_header(&header) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(0, ErrorCode::Handshake, &e.to_string()).await),
        };
        let Op::Hello { version, client } = req.op else {
            return Err(self
                .fail(req.id, ErrorCode::Handshake, "first frame must be Hello")
                .await);
        };
        if version != PROTOCOL_VERSION || prefix.payload_len != 0 {
            let msg = format!(
                "protocol version {version} not supported; this daemon speaks {PROTOCOL_VERSION}"
            );
            return Err(self.fail(req.id, ErrorCode::Handshake, &msg).await);
        }
        tracing::debug!(conn = self.id, client = %client, "handshake");
        let reply = Response {
            id: req.id,
            reply: Reply::HelloOk {
                version: PROTOCOL_VERSION,
                server: format!("kvnode {}", env!("CARGO_PKG_VERSION")),
                pid: std::process::id(),
                arena_bytes: self.engine.arena.len(),
            },
        };
        let frame = encode_frame(&reply, 0).map_err(|e| End::Protocol(e.to_string()))?;
        let engine = Arc::clone(&self.engine);
        self.io
            .write_with_fd(&frame, engine.arena.fd())
            .await
            .map_err(End::Io)
    }

    /// Sends an error frame and returns the protocol end reason.
    async fn fail(&mut self, id: u64, code: ErrorCode, msg: &str) -> End {
        // Best effort: the peer may already be gone.
        let _ = self
            .send(
                id,
                Reply::Error {
                    code,
                    message: msg.to_owned(),
                },
                &[],
            )
            .await;
        End::Protocol(msg.to_owned())
    }

    /// Sends a reply header followed by `payload` slices.
    pub async fn send(&mut self, id: u64, reply: Reply, payload: &[&[u8]]) -> std::io::Result<()> {
        let total: u64 = payload.iter().map(|p| p.len() as u64).sum();
        self.reply_info = self.engine.metrics.reply(&reply, total);
        let frame = encode_frame(&Response { id, reply }, total)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(payload.len() + 1);
        slices.push(IoSlice::new(&frame));
        slices.extend(payload.iter().map(|p| IoSlice::new(p)));
        self.io.write_all(&mut slices).await
    }

    async fn serve(&mut self) -> End {
        loop {
            let next = tokio::select! {
                r = self.io.read_frame() => r,
                _ = self.stop.changed() => return End::Closed,
            };
            let (prefix, header) = match next {
                Ok(Incoming::Frame(p, h)) => (p, h),
                Ok(Incoming::Closed) => return End::Closed,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    // The prefix is unusable: we cannot find the next frame boundary.
                    return self.fail(0, ErrorCode::Malformed, &e.to_string()).await;
                }
                Err(e) => return End::Io(e),
            };
            if let Err(end) = self.dispatch(prefix, &header).await {
                return end;
            }
        }
    }

    async fn dispatch(&mut self, prefix: FramePrefix, header: &[u8]) -> Result<(), End> {
        let req: Request = match decode_header(header) {
            Ok(r) => r,
            Err(e) => {
                // Framing is intact: skip the payload, report, and carry on.
                self.io
                    .skip(u64::from(prefix.payload_len))
                    .await
                    .map_err(End::Io)?;
                self.send(
                    0,
                    Reply::Error {
                        code: ErrorCode::Malformed,
                        message: e.to_string(),
                    },
                    &[],
                )
                .await
                .map_err(End::Io)?;
                return Ok(());
            }
        };
        if self.stop_requested() {
            self.io
                .skip(u64::from(prefix.payload_len))
                .await
                .map_err(End::Io)?;
            let msg = "daemon is shutting down".to_owned();
            self.send(
                req.id,
                Reply::Error {
                    code: ErrorCode::ShuttingDown,
                    message: msg,
                },
                &[],
            )
            .await
            .map_err(End::Io)?;
            return Err(End::Closed);
        }
        let (op, id, (ns, pages)) = (OpKind::of(&req.op), req.id, obs::shape(&req.op));
        let payload = u64::from(prefix.payload_len);
        let t0 = self.engine.metrics.op_begin(&self.watch, id, op, ns, pages);
        self.reply_info = ReplyInfo::default();
        let r = self.handle(req, payload).await;
        let status = match (&r, self.reply_info.status) {
            (Ok(()), Some(s)) => s,
            _ => OpStatus::Io,
        };
        let bytes = if op == OpKind::Put {
            payload
        } else {
            self.reply_info.bytes
        };
        let m = &self.engine.metrics;
        m.op_end(&self.watch, id, op, ns, pages, bytes, status, t0);
        r.map_err(End::Io)
    }

    fn stop_requested(&self) -> bool {
        *self.stop.borrow()
    }
}
