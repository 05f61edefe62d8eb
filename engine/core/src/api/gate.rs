//! The accept gate: who is turned away before a session exists.
//!
//! At accept the daemon reads the client's `SO_PEERCRED` and decides at once (`admit`): a
//! refused identity (allowlist, `unmapped = "refuse"`, unreadable credentials) gets
//! `Error { Handshake }` with the reason right away, without waiting for its `Hello`, and
//! the connection is closed (after at most [`REFUSED_LINGER`] so that a `Hello` already on
//! its way does not turn the reply into a reset). An admitted uid may hold at most
//! `max_pre_hello_per_uid` connections that have not completed their `Hello`; the next is
//! refused the same way. An admitted uid may hold at most its tenant's `connections_per_uid`
//! connections at once (`[tenants.limits]`); the next is refused with `Error { LimitReached }`
//! and counted on the tenant. Neither path allocates a session or read buffers. At most
//! [`MAX_LINGERING_PER_UID`] refused connections of one uid linger; past that a refusal is
//! written once without waiting and the connection closed at once.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvnode_fdpass::PeerCred;
use kvnode_proto::client::{ErrorCode, Reply, Response};
use kvnode_proto::frame::encode_frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::tenancy::admit;
use crate::engine::Engine;
use crate::obs::Refusal;
use crate::tenant::{Charge, Held, TenantId};

/// How long a refused connection is kept to let the client read the refusal.
pub const REFUSED_LINGER: Duration = Duration::from_secs(1);

/// Refused connections of one uid kept open (up to [`REFUSED_LINGER`]) for their client to
/// read the refusal; past this many the next refusal is written without waiting and the
/// connection closed at once, so a uid connecting in a loop past its caps, never closing,
/// cannot hold the daemon's descriptors that way.
pub const MAX_LINGERING_PER_UID: u32 = 16;

/// Connections per uid in one state (not yet past `Hello`, or refused and lingering).
#[derive(Debug, Default)]
pub struct PerUid {
    by_uid: Mutex<HashMap<u32, u32>>,
}

/// The accept gate's per-uid tables.
#[derive(Debug, Default)]
pub struct Gate {
    /// Connections that have not completed their `Hello`.
    pub pre_hello: Arc<PerUid>,
    /// Refused connections kept open for their client to read why.
    pub lingering: Arc<PerUid>,
}

/// One connection of a uid counted in a [`PerUid`] table; dropped when it leaves that
/// state (a pre-`Hello` slot: when its handshake ends either way).
#[derive(Debug)]
pub struct PreHelloSlot {
    table: Arc<PerUid>,
    uid: u32,
}

impl Drop for PreHelloSlot {
    fn drop(&mut self) {
        let mut m = self
            .table
            .by_uid
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = m.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.uid);
            }
        }
    }
}

impl PerUid {
    /// A slot for one more connection of `uid` in this state, unless it has `cap` already.
    pub fn enter(self: &Arc<Self>, uid: u32, cap: u32) -> Option<PreHelloSlot> {
        let mut m = self.by_uid.lock().unwrap_or_else(PoisonError::into_inner);
        let n = m.entry(uid).or_default();
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(PreHelloSlot {
            table: Arc::clone(self),
            uid,
        })
    }
}

/// An accepted connection the gate let through.
#[derive(Debug)]
pub struct Admitted {
    /// The stream.
    pub stream: UnixStream,
    /// Its credentials (default when unreadable and no access control is configured).
    pub cred: PeerCred,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its pre-`Hello` slot, held until the handshake ends.
    pub slot: PreHelloSlot,
    /// Its place under the uid's `connections_per_uid`, held until the connection ends.
    pub charge: Charge,
}

/// A connection turned away at accept: [`Refused::answer`] tells it why and closes it.
#[derive(Debug)]
pub struct Refused {
    stream: UnixStream,
    code: ErrorCode,
    msg: String,
    /// Its place among its uid's lingering refusals; `None`: no lingering.
    linger: Option<PreHelloSlot>,
}

/// Decides about a just-accepted connection: let through, or refused (logged and counted
/// here; the caller runs [`Refused::answer`]).
pub fn screen(engine: &Arc<Engine>, gate: &Gate, stream: UnixStream) -> Result<Admitted, Refused> {
    let got = kvnode_fdpass::peer_cred(stream.as_raw_fd());
    let admission = admit(&engine.config, engine.tenants(), &got);
    let cred: PeerCred = got.unwrap_or_default();
    let refused = |stream: UnixStream, why: Refusal, msg: String| {
        engine.metrics.client_refused(why);
        let code = if why == Refusal::ConnectionCap {
            ErrorCode::LimitReached
        } else {
            ErrorCode::Handshake
        };
        tracing::warn!(
            pid = cred.pid,
            uid = cred.uid,
            gid = cred.gid,
            reason = %msg,
            "client refused at accept (see kvnode_clients_refused_total)"
        );
        let linger = gate.lingering.enter(cred.uid, MAX_LINGERING_PER_UID);
        Refused {
            stream,
            code,
            msg,
            linger,
        }
    };
    let tenant = match admission {
        Ok(t) => t,
        Err((why, msg)) => return Err(refused(stream, why, msg)),
    };
    let cap = engine.config.max_pre_hello_per_uid;
    let Some(slot) = gate.pre_hello.enter(cred.uid, cap) else {
        let msg = format!(
            "uid {} already has {cap} connections that have not sent Hello (max_pre_hello_per_uid)",
            cred.uid
        );
        return Err(refused(stream, Refusal::PreHelloCap, msg));
    };
    let charge = match engine
        .tenants()
        .charge(cred.uid, tenant, Held::Connections, 1)
    {
        Ok(c) => c,
        Err(over) => return Err(refused(stream, Refusal::ConnectionCap, over.to_string())),
    };
    Ok(Admitted {
        stream,
        cred,
        tenant,
        slot,
        charge,
    })
}

impl Refused {
    /// Sends `Error { code, msg }` (`Handshake`, or `LimitReached` at the connection cap) at once, then closes once the client has closed or
    /// [`REFUSED_LINGER`] passed, reading (and dropping) at most 4 KiB meanwhile.
    pub async fn answer(self) {
        let Self {
            mut stream,
            code,
            msg,
            linger,
        } = self;
        let reply = Response {
            id: 0,
            reply: Reply::Error { code, message: msg },
        };
        let Ok(frame) = encode_frame(&reply, 0) else {
            return;
        };
        if linger.is_none() {
            // Its uid has enough refusals lingering: one try to write, then closed.
            let _ = stream.try_write(&frame);
            return;
        }
        let sent = tokio::time::timeout(REFUSED_LINGER, stream.write_all(&frame)).await;
        if !matches!(sent, Ok(Ok(()))) {
            return;
        }
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(REFUSED_LINGER, async {
            let mut left = sink.len();
            while left > 0 {
                match stream.read(&mut sink[..left]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => left -= n,
                }
            }
        })
        .await;
    }
}
