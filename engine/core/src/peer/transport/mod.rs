//! Peer transports: how frames and block bodies move between daemons (TCP; RDMA can follow).
//!
//! Every frame after the handshake is sealed by the session's [`channel::Channel`] (a keyed
//! tag per frame and direction, or AES-256-GCM when encrypted), whatever the transport.
//!
//! A dialled connection lives twice. It is connected and authenticated on the runtime as a
//! [`TcpConn`] (the source's end stays one: it answers pulls with async sends). The
//! destination's end then becomes a [`PullWire`], a blocking connection owned by the one
//! thread that pulls a chunk over it, so each block body is received by the kernel straight
//! into its reserved slot with no runtime wake-up between reads. [`PullWire`] is an enum over
//! the transports built from `[peer]` configuration ([`Transport`]), dispatched with a
//! `match` on every call (no vtable on the per-block path). Each arm implements [`PullConn`]:
//!
//! - [`TcpPull`]: the TCP transport (block bodies on the connection).
//! - [`UcxPull`]: frames on that TCP connection, block bytes read with one-sided UCX GETs
//!   from the source's registered arena (`--peer-transport ucx|auto`).
//! - [`FaultyConn`]: [`TcpPull`] with faults injected where bytes land (a stalled, cut or
//!   corrupted block), for tests of the fetch path; enabled by `[peer] debug_fault` only.
//!
//! RDMA hardware is reached through UCX (verbs on InfiniBand/RoCE); only UCX's TCP and
//! shared-memory transports were exercised here (docs/peer-protocol.md).

pub mod channel;
#[cfg(feature = "test-seams")]
mod faulty;
mod tcp;
mod tcp_pull;
mod ucx;
mod ucx_setup;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
#[cfg(feature = "test-seams")]
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use kvnode_blockmac::BlockMac;
use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerMsg;
use tokio::net::{TcpListener, TcpStream};

#[cfg(feature = "test-seams")]
pub use faulty::{FaultPlan, FaultyConn};
pub use tcp::TcpConn;
pub use tcp_pull::TcpPull;
pub use ucx::{UcxExposure, UcxNode, UcxPeer, UcxPull, UcxSetup, UcxStartError};
pub use ucx_setup::{UcxAsked, interface_of};

use super::PeerError;
use super::error::{HandshakeError, Stage};

/// A received frame: the message and, for `Block`, the unread payload length.
pub type Frame = (PeerMsg, u32);

/// What the destination's pull loop needs from one connection of a transport: all it uses.
/// Calls block the calling thread (a blocking-pool thread, never a runtime worker), but for
/// [`PullConn::send_early`].
///
/// Contract: frames arrive in the order they were sent; after [`PullConn::recv`] returns a
/// `Block` of `len` bytes, exactly `len` bytes are consumed by [`PullConn::read_payload`]
/// calls (in order, into buffers the caller owns) before the next `recv`; the transport
/// writes a caller's buffer only inside `read_payload`, or, for a `Slot`, between a GET's
/// [`SlotReads::post`] and the moment [`SlotReads::land_one`] reports it (or
/// [`SlotReads::abandon`] hands it back), so once those return the buffer no longer
/// changes. Every wait is bounded by the `limit` given. A transport whose answers carry
/// their bodies has no [`PullConn::slots`]: a `Slot` or a UCX offer on it breaks the
/// protocol.
pub trait PullConn: Send {
    /// One-sided reads of the source's memory, where the transport has them.
    type Slots: SlotReads;
    /// The remote address.
    fn remote(&self) -> SocketAddr;
    /// Seals `msgs` and hands the socket what it takes now, never waiting, so a runtime
    /// worker may call it; the rest goes out first in the next blocking call, in order.
    fn send_early(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError>;
    /// Sends several payload-less frames at once (pipelined requests).
    fn send_all(&mut self, msgs: &[PeerMsg], limit: Duration) -> Result<(), PeerError>;
    /// Receives the next frame header within `limit`.
    fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError>;
    /// Fills `dst` with the next payload bytes; each receive call waits at most `limit`.
    fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError>;
    /// Decrypts and checks, in place, the whole body of the last `Block` received, against
    /// the tag its header carried (`seal`). A no-op when the session only authenticates.
    fn open_payload(&mut self, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError>;
    /// Whether bodies arrive encrypted (then they are opened whole, after the last byte).
    fn encrypted(&self) -> bool;
    /// Id of the cluster key the session was derived from (`None`: keyless).
    fn key_id(&self) -> Option<u64>;
    /// The session's block MAC (keyed plaintext sessions): checks `Block` bodies and the
    /// bytes of `Slot` GETs.
    fn block_mac(&self) -> Option<Arc<BlockMac>>;
    /// The connection's one-sided reads (`Slot` answers), if it negotiated them.
    fn slots(&mut self) -> Option<&mut Self::Slots>;
}

/// One-sided reads (GETs) of the source's registered memory, named by `Slot` answers.
pub trait SlotReads {
    /// GETs posted and not yet landed or handed back.
    fn in_flight(&self) -> usize;
    /// Most GETs in flight at once.
    fn window(&self) -> usize;
    /// Starts the GET of `len` bytes at the source's `addr` into `dst`, reported under `tag`.
    ///
    /// # Safety
    ///
    /// `dst` must stay valid and untouched until the GET is reported by
    /// [`SlotReads::land_one`] or handed back by [`SlotReads::abandon`].
    unsafe fn post(
        &mut self,
        dst: *mut u8,
        len: usize,
        addr: u64,
        tag: u64,
    ) -> Result<(), PeerError>;
    /// Waits up to `limit` for some GET in flight to finish: its tag, and its outcome (an
    /// error there is a failed GET whose buffer is quiet). A timeout when none finished.
    fn land_one(&mut self, limit: Duration) -> Result<(u64, Result<(), PeerError>), PeerError>;
    /// Cancels every GET in flight; waits up to `limit` for them to be handed back. Returns
    /// the tags of those kept: their buffers may still be written and must be retired.
    fn abandon(&mut self, limit: Duration) -> Vec<u64>;
    /// Takes the new key (and worker address) a source sent after re-registering its memory.
    fn rekey(&mut self, worker: &[u8], rkey: &[u8], base: u64, len: u64) -> Result<(), PeerError>;
}

/// The one-sided reads of a transport that has none.
#[derive(Debug)]
pub enum NoSlots {}

impl SlotReads for NoSlots {
    fn in_flight(&self) -> usize {
        match *self {}
    }

    fn window(&self) -> usize {
        match *self {}
    }

    unsafe fn post(&mut self, _: *mut u8, _: usize, _: u64, _: u64) -> Result<(), PeerError> {
        match *self {}
    }

    fn land_one(&mut self, _: Duration) -> Result<(u64, Result<(), PeerError>), PeerError> {
        match *self {}
    }

    fn abandon(&mut self, _: Duration) -> Vec<u64> {
        match *self {}
    }

    fn rekey(&mut self, _: &[u8], _: &[u8], _: u64, _: u64) -> Result<(), PeerError> {
        match *self {}
    }
}

/// Bounds an I/O future by `limit`.
async fn bounded<T>(
    limit: Duration,
    stage: Stage,
    f: impl Future<Output = io::Result<T>>,
) -> Result<T, PeerError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PeerError::timeout(stage, limit)),
    }
}

/// The destination's end of one peer connection, of whichever transport is configured.
#[derive(Debug)]
pub enum PullWire {
    /// Plain TCP.
    Tcp(TcpPull),
    /// UCX GETs for block bytes, TCP for frames.
    Ucx(Box<UcxPull>),
    /// TCP with injected faults (tests only).
    #[cfg(feature = "test-seams")]
    Faulty(Box<FaultyConn>),
}

/// Calls one method of whichever transport `$w` is.
macro_rules! each {
    ($w:expr, $c:ident => $e:expr) => {
        match $w {
            PullWire::Tcp($c) => $e,
            PullWire::Ucx($c) => $e,
            #[cfg(feature = "test-seams")]
            PullWire::Faulty($c) => $e,
        }
    };
}

impl PullConn for PullWire {
    type Slots = UcxPull;

    fn remote(&self) -> SocketAddr {
        each!(self, c => c.remote())
    }

    fn send_early(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        each!(self, c => c.send_early(msgs))
    }

    fn send_all(&mut self, msgs: &[PeerMsg], limit: Duration) -> Result<(), PeerError> {
        each!(self, c => c.send_all(msgs, limit))
    }

    fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        each!(self, c => c.recv(limit))
    }

    fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
        each!(self, c => c.read_payload(dst, limit))
    }

    fn open_payload(&mut self, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        each!(self, c => c.open_payload(body, seal))
    }

    fn encrypted(&self) -> bool {
        each!(self, c => c.encrypted())
    }

    fn key_id(&self) -> Option<u64> {
        each!(self, c => c.key_id())
    }

    fn block_mac(&self) -> Option<Arc<BlockMac>> {
        each!(self, c => c.block_mac())
    }

    fn slots(&mut self) -> Option<&mut UcxPull> {
        match self {
            Self::Ucx(c) => Some(c),
            Self::Tcp(_) => None,
            #[cfg(feature = "test-seams")]
            Self::Faulty(_) => None,
        }
    }
}

/// The transport a daemon dials and listens with, built from `[peer]` configuration.
#[derive(Debug, Clone)]
pub enum Transport {
    /// TCP (the default).
    Tcp,
    /// TCP whose dialled connections inject `plan`'s faults; the block count is shared by
    /// every connection, so each fault fires once per daemon.
    #[cfg(feature = "test-seams")]
    Faulty(FaultPlan, Arc<AtomicU32>),
}

impl Transport {
    /// The transport `debug_fault` asks for (TCP without it).
    #[cfg(feature = "test-seams")]
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

    /// The transport a configuration asks for: TCP (fault injection is compiled only into
    /// test builds, feature `test-seams`).
    pub fn from_config(cfg: &crate::peer::PeerConfig) -> Self {
        #[cfg(feature = "test-seams")]
        return Self::from_plan(cfg.debug_fault.as_ref());
        #[cfg(not(feature = "test-seams"))]
        {
            let _ = cfg;
            Self::Tcp
        }
    }

    /// Resolves `host:port` and connects to it, unless `refuse` says no to any address it
    /// resolves to (this daemon itself): then nothing is dialled. The caller bounds the
    /// wait and runs the handshake.
    pub async fn dial(
        &self,
        target: &Endpoint,
        refuse: impl Fn(SocketAddr) -> bool,
    ) -> Result<TcpConn, PeerError> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
            .await?
            .collect();
        if let Some(a) = addrs.iter().find(|a| refuse(**a)) {
            return Err(HandshakeError::SelfDial {
                target: target.clone(),
                addr: *a,
            }
            .into());
        }
        Ok(TcpConn::new(TcpStream::connect(&addrs[..]).await?)?)
    }

    /// Whether UCX may be negotiated on dialled connections (not with injected faults,
    /// which act on TCP bodies).
    pub fn plain(&self) -> bool {
        matches!(self, Self::Tcp)
    }

    /// The destination's end of an authenticated connection, ready to pull on: a UCX one
    /// when `ucx` holds the endpoint negotiated on it.
    pub fn pull_end(
        &self,
        c: TcpConn,
        ucx: Option<(UcxPeer, Arc<UcxNode>)>,
    ) -> io::Result<PullWire> {
        let tcp = c.into_pull()?;
        if let Some((peer, node)) = ucx {
            return Ok(PullWire::Ucx(Box::new(UcxPull::new(tcp, peer, node))));
        }
        Ok(match self {
            Self::Tcp => PullWire::Tcp(tcp),
            #[cfg(feature = "test-seams")]
            Self::Faulty(plan, seen) => PullWire::Faulty(Box::new(FaultyConn::new(
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
    pub async fn accept(&self) -> io::Result<TcpConn> {
        let (s, _) = self.0.accept().await?;
        TcpConn::new(s)
    }
}
