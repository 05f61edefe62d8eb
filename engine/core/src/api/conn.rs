//! One client connection: handshake, the request loop, and its end.

use std::sync::Arc;

use kvnode_proto::PROTOCOL_VERSION;
use kvnode_proto::client::{ErrorCode, Op, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, decode_header, encode_frame};
use kvnode_proto::obs::{OpKind, OpStatus};
use tokio::sync::watch;

use super::gate::{Admitted, PreHelloSlot};
use super::io::{Incoming, SockIo};
use super::session::Session;
use crate::engine::Engine;
use crate::obs;
use crate::obs::ReplyInfo;

/// A connection the accept gate let through: its session, its pre-`Hello` slot (until the
/// handshake ends), and the daemon's stop signal.
#[derive(Debug)]
pub(super) struct Connection {
    s: Session,
    slot: Option<PreHelloSlot>,
    stop: watch::Receiver<bool>,
}

/// Why a connection ends.
enum End {
    Closed,
    Io(std::io::Error),
    Protocol(String),
}

impl Connection {
    pub fn new(engine: Arc<Engine>, a: Admitted, stop: watch::Receiver<bool>) -> Self {
        Self {
            s: Session::new(engine, SockIo::new(a.stream), a.cred, a.tenant, a.charge),
            slot: Some(a.slot),
            stop,
        }
    }

    pub async fn run(mut self) {
        let (id, cred) = (self.s.id, self.s.cred);
        tracing::info!(
            conn = id,
            pid = cred.pid,
            uid = cred.uid,
            gid = cred.gid,
            "client connected"
        );
        let shook = self.handshake().await;
        self.slot = None; // (a failed handshake still holds it until here)
        let end = match shook {
            Ok(()) => {
                self.s.io.ready();
                self.serve().await
            }
            Err(e) => e,
        };
        match end {
            End::Closed => tracing::info!(conn = id, "client disconnected"),
            End::Io(e) => tracing::info!(conn = id, error = %e, "client connection ended"),
            End::Protocol(why) => {
                tracing::warn!(conn = id, pid = cred.pid, reason = %why, "client dropped");
            }
        }
        // GPU copies must finish before their leases go; the session's drop releases the rest.
        self.s.gpu_cleanup().await;
    }

    async fn handshake(&mut self) -> Result<(), End> {
        let limit = std::time::Duration::from_secs_f64(self.s.engine.config.hello_timeout_s);
        let first = tokio::time::timeout(limit, self.s.io.read_frame()).await;
        let (prefix, header) = match first {
            Ok(Ok(Incoming::Frame(p, h))) => (p, h),
            Ok(Ok(Incoming::Closed)) => return Err(End::Closed),
            Ok(Err(e)) => return Err(self.fail(0, ErrorCode::Handshake, &e.to_string()).await),
            Err(_) => {
                let msg = format!("no Hello within hello_timeout_s = {}", limit.as_secs_f64());
                return Err(self.fail(0, ErrorCode::Handshake, &msg).await);
            }
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
        tracing::debug!(conn = self.s.id, client = %client, "handshake");
        // A valid Hello ends the pre-Hello state: the slot goes before HelloOk is sent, so
        // a client that has read its HelloOk never still counts against its uid's cap.
        self.slot = None;
        let arena = Arc::clone(self.s.engine.store.arena());
        // Without the mapping (a tenant with share_arena = false) no descriptor goes out
        // and `arena_bytes` is 0.
        let share = self.s.engine.tenants().get(self.s.tenant).share_arena;
        let reply = Response {
            id: req.id,
            reply: Reply::HelloOk {
                version: PROTOCOL_VERSION,
                server: format!("kvnode {}", env!("CARGO_PKG_VERSION")),
                pid: std::process::id(),
                arena_bytes: if share { arena.len() } else { 0 },
            },
        };
        let frame = encode_frame(&reply, 0).map_err(|e| End::Protocol(e.to_string()))?;
        let sent = if share {
            self.s.io.write_with_fd(&frame, arena.fd()).await
        } else {
            self.s
                .io
                .write_all(&mut [std::io::IoSlice::new(&frame)])
                .await
        };
        sent.map_err(End::Io)
    }

    /// Sends an error frame and returns the protocol end reason.
    async fn fail(&mut self, id: u64, code: ErrorCode, msg: &str) -> End {
        // Best effort: the peer may already be gone.
        let _ = self.error(id, code, msg.to_owned()).await;
        End::Protocol(msg.to_owned())
    }

    async fn error(&mut self, id: u64, code: ErrorCode, message: String) -> std::io::Result<()> {
        self.s.send(id, Reply::Error { code, message }, &[]).await
    }

    async fn serve(&mut self) -> End {
        loop {
            let next = tokio::select! {
                r = self.s.io.read_frame() => r,
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
        let payload = u64::from(prefix.payload_len);
        let req: Request = match decode_header(header) {
            Ok(r) => r,
            Err(e) => {
                // Framing is intact: skip the payload, report, and carry on.
                self.s.io.skip(payload).await.map_err(End::Io)?;
                let msg = e.to_string();
                return self
                    .error(0, ErrorCode::Malformed, msg)
                    .await
                    .map_err(End::Io);
            }
        };
        if *self.stop.borrow() {
            self.s.io.skip(payload).await.map_err(End::Io)?;
            let msg = "daemon is shutting down".to_owned();
            self.error(req.id, ErrorCode::ShuttingDown, msg)
                .await
                .map_err(End::Io)?;
            return Err(End::Closed);
        }
        let (op, id, (ns, pages)) = (req.op.kind(), req.id, obs::shape(&req.op));
        let m = Arc::clone(&self.s.engine.metrics);
        let t0 = m.op_begin(&self.s.watch, id, op, ns, pages);
        self.s.reply_info = ReplyInfo::default();
        let r = self.s.handle(req, payload).await;
        let status = match (&r, self.s.reply_info.status) {
            (Ok(()), Some(s)) => s,
            _ => OpStatus::Io,
        };
        let bytes = if op == OpKind::Put {
            payload
        } else {
            self.s.reply_info.bytes
        };
        m.op_end(&self.s.watch, id, op, ns, pages, bytes, status, t0);
        r.map_err(End::Io)
    }
}
