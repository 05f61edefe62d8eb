//! Peer transports: how frames and block bodies move between daemons (TCP; RDMA can follow).
//!
//! The pull protocol (`auth`, `source`, `fetch`) talks to a [`PeerWire`], an enum over the
//! transports built from `[peer]` configuration ([`Transport`]), dispatched with a `match`
//! on every call (no vtable on the per-block path). Each arm implements [`PeerConn`]:
//!
//! - [`TcpConn`]: the real transport; block bodies are read by the kernel straight into the
//!   caller's buffer (a reserved DRAM slot).
//! - [`FaultyConn`]: TCP with faults injected where bytes land (a stalled, cut or corrupted
//!   block), for tests of the fetch path; enabled by `[peer] debug_fault` only.
//!
//! An RDMA transport is not implemented (no RDMA hardware here); docs/peer-protocol.md says
//! what it must provide to become a third arm.

mod faulty;
mod tcp;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use kvnode_proto::peer::PeerMsg;
use tokio::net::{TcpListener, TcpStream};

pub use faulty::{FaultPlan, FaultyConn};
pub use tcp::TcpConn;

use super::PeerError;

/// A received frame: the message and, for `Block`, the unread payload length.
pub type Frame = (PeerMsg, u32);

/// What the pull protocol needs from one connection of a transport.
///
/// Contract: frames arrive in the order they were sent; after [`PeerConn::recv`] returns a
/// `Block` of `len` bytes, exactly `len` bytes are consumed by [`PeerConn::read_payload`]
/// calls (in order, into buffers the caller owns) before the next `recv`; the transport
/// writes a caller's buffer only inside `read_payload`, so when that returns (or its future
/// is dropped) the buffer no longer changes. Every wait is bounded by the `limit` given.
pub trait PeerConn: Send {
    /// The remote address (loopback checks of keyless peers).
    fn remote(&self) -> SocketAddr;
    /// Sends one frame: `msg`, then `payload` (non-empty only for `Block`).
    fn send(
        &mut self,
        msg: &PeerMsg,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), PeerError>> + Send;
    /// Sends several payload-less frames at once (pipelined requests).
    fn send_all(&mut self, msgs: &[PeerMsg]) -> impl Future<Output = Result<(), PeerError>> + Send;
    /// Receives the next frame header within `limit`.
    fn recv(&mut self, limit: Duration) -> impl Future<Output = Result<Frame, PeerError>> + Send;
    /// Fills `dst` with the next payload bytes, with no progress gap longer than `limit`.
    fn read_payload(
        &mut self,
        dst: &mut [u8],
        limit: Duration,
    ) -> impl Future<Output = Result<(), PeerError>> + Send;
}

/// Bounds an I/O future by `limit`.
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

/// One peer connection of whichever transport is configured.
#[derive(Debug)]
pub enum PeerWire {
    /// Plain TCP.
    Tcp(TcpConn),
    /// TCP with injected faults (tests only).
    Faulty(Box<FaultyConn>),
}

impl PeerWire {
    /// The remote address.
    pub fn remote(&self) -> SocketAddr {
        match self {
            Self::Tcp(c) => c.remote(),
            Self::Faulty(c) => c.remote(),
        }
    }

    /// See [`PeerConn::send`].
    pub async fn send(&mut self, msg: &PeerMsg, payload: &[u8]) -> Result<(), PeerError> {
        match self {
            Self::Tcp(c) => c.send(msg, payload).await,
            Self::Faulty(c) => c.send(msg, payload).await,
        }
    }

    /// See [`PeerConn::send_all`].
    pub async fn send_all(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        match self {
            Self::Tcp(c) => c.send_all(msgs).await,
            Self::Faulty(c) => c.send_all(msgs).await,
        }
    }

    /// See [`PeerConn::recv`].
    pub async fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        match self {
            Self::Tcp(c) => c.recv(limit).await,
            Self::Faulty(c) => c.recv(limit).await,
        }
    }

    /// See [`PeerConn::read_payload`].
    pub async fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
        match self {
            Self::Tcp(c) => c.read_payload(dst, limit).await,
            Self::Faulty(c) => c.read_payload(dst, limit).await,
        }
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

/// The transport a daemon dials and listens with, built from `[peer]` configuration.
#[derive(Debug, Clone)]
pub enum Transport {
    /// TCP (the default).
    Tcp,
    /// TCP whose dialled connections inject `plan`'s faults; the block count is shared by
    /// every connection, so each fault fires once per daemon.
    Faulty(FaultPlan, Arc<AtomicU32>),
}

impl Transport {
    /// The transport `debug_fault` asks for (TCP without it).
    pub fn from_plan(plan: Option<&FaultPlan>) -> Self {
        match plan {
            None => Self::Tcp,
            Some(p) => {
                tracing::warn!(
                    ?p,
                    "peer fault injection is ON (debug_fault): for tests only"
                );
                Self::Faulty(p.clone(), Arc::new(AtomicU32::new(0)))
            }
        }
    }

    /// Connects to `host:port` (the caller bounds the wait).
    pub async fn dial(&self, host: &str, port: u16) -> io::Result<PeerWire> {
        let tcp = TcpConn::new(TcpStream::connect((host, port)).await?)?;
        Ok(match self {
            Self::Tcp => PeerWire::Tcp(tcp),
            Self::Faulty(plan, seen) => PeerWire::Faulty(Box::new(FaultyConn::new(
                tcp,
                plan.clone(),
                Arc::clone(seen),
            ))),
        })
    }

    /// Listens on `addr` for peers.
    pub async fn bind(&self, addr: &str) -> io::Result<PeerListener> {
        Ok(PeerListener(TcpListener::bind(addr).await?))
    }
}

/// Accepts peer connections (faults are injected only on the dialling side, where pulled
/// bytes land).
#[derive(Debug)]
pub struct PeerListener(TcpListener);

impl PeerListener {
    /// Wraps a bound TCP listener.
    pub fn tcp(l: TcpListener) -> Self {
        Self(l)
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }

    /// The next connection.
    pub async fn accept(&self) -> io::Result<PeerWire> {
        let (s, _) = self.0.accept().await?;
        Ok(PeerWire::Tcp(TcpConn::new(s)?))
    }
}
