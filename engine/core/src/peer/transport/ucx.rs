//! The UCX transport: the source registers its whole DRAM arena with UCX once and answers
//! pulls with where each leased block lies ([`PeerMsg::Slot`]); the destination reads it
//! with a one-sided `ucp_get_nbx` into a slot it reserved. Over InfiniBand/RoCE UCX does
//! that with an RDMA READ (the source's CPU is not involved); over UCX's TCP transport, as
//! exercised here, the source's UCX progress thread serves the GET from the registered
//! memory (no copy by kvnode's own code, but a socket send by UCX).
//!
//! Frames (pulls, answers, `Landed`) stay on the TCP connection, sealed by its session
//! (every header AES-256-GCM ciphertext under an implicit sequence number); only block bytes
//! move through UCX, and each landed block is checked against the BLAKE3 hash its sealed
//! `Slot` carried before it is committed. The worker address, remote key and arena bounds
//! travel in a sealed (so encrypted) [`PeerMsg::UcxOffer`], only after the handshake, and are
//! never logged; slot addresses only in sealed `Slot`s. An encrypted session
//! (`--peer-encrypt`) is never offered UCX: GETs would move the bytes in the clear.
//!
//! What the key exposes: it lets the holder read the source's whole arena (every block of
//! every namespace), not just the leased slots, and never write it (the offered
//! registration is remote-read-only, the landing one local-only; enforced by verbs NICs,
//! not by UCX's TCP transport). Only authenticated members get it, and
//! [`UcxNode::reregister`] revokes it (unmap, map again, new key) on demand; connections
//! receive the new key in band before their next answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvnode_blockmac::BlockMac;
use kvnode_proto::peer::PeerMsg;
use kvnode_ucx::{
    Access, Context, MemoryKind, PackedRkey, Progress, Region, Remote, Resources, UcxError,
    WorkerAddress,
};

use super::{Frame, PullConn, SlotReads, TcpPull};
use crate::peer::PeerError;
pub use crate::peer::error::UcxStartError;
use crate::peer::error::{PullError, Stage, Violation, WireError, list};
use crate::store::Store;

/// Which transports this daemon lets UCX expose its memory over (`[peer]
/// ucx_insecure_software_rma`, `ucx_net_devices`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UcxExposure {
    /// Only transports whose NIC checks every RDMA access against the memory key (verbs
    /// RC/DC; UD for wire-up): the context gets [`kvnode_ucx::HARDWARE_TLS`] unless
    /// `UCX_TLS` names the transports, and start-up fails if any selected transport would
    /// serve RMA in software. The default.
    HardwareOnly,
    /// Whatever `UCX_TLS` selects, software RMA included, on these network devices only
    /// (`UCX_NET_DEVICES`: the peer interface). Every process that reaches them can read
    /// and overwrite the whole arena and crash the daemon: a trusted network only.
    TrustedNetwork {
        /// `UCX_NET_DEVICES` value (`lo`, `eth1`, ...).
        net_devices: String,
    },
}

/// How this daemon's UCX starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxSetup {
    /// GETs each connection keeps in flight at most (`[peer] ucx_gets_in_flight`).
    pub window: usize,
    /// Which transports may carry RMA.
    pub exposure: UcxExposure,
    /// Whether this daemon serves pulls (has a peer listener): only then is a worker
    /// started for peers to read from and the arena registered for remote reads.
    pub serve: bool,
}

/// This daemon's UCX state: context, two registrations of the arena and the worker peers
/// read through (driven by its own thread).
///
/// The arena is registered twice: `exposed` is the one whose key peers get (re-registered to
/// revoke it), `landing` is the local registration GETs land in (its key is never packed),
/// so revoking does not wait for this daemon's own pooled connections to go away. A daemon
/// without a peer listener has neither `serving` nor `exposed`: no worker of its own listens
/// and no key to its arena exists.
#[derive(Debug)]
pub struct UcxNode {
    /// Dropped before `store` (field order): no registration outlives the arena.
    serving: Option<Progress>,
    exposed: RwLock<Option<Region>>,
    landing: Arc<Region>,
    generation: AtomicU64,
    /// GETs each connection keeps in flight at most (`[peer] ucx_gets_in_flight`).
    window: usize,
    /// The most GETs any connection had in flight at once (a statistic, and for tests).
    max_in_flight: AtomicUsize,
    /// The transports the context selected (for the start-up line).
    resources: Resources,
    ctx: Context,
    store: Arc<Store>,
}

impl UcxNode {
    /// Initializes UCX under `setup.exposure` (reading `UCX_*` from the environment, then
    /// overriding what the exposure fixes), registers `store`'s arena and, when serving,
    /// starts the progress thread peers read through.
    pub fn start(store: &Arc<Store>, setup: &UcxSetup) -> Result<Self, UcxStartError> {
        let ctx = match &setup.exposure {
            UcxExposure::HardwareOnly if std::env::var_os("UCX_TLS").is_none() => {
                Context::with_settings(&[("TLS", kvnode_ucx::HARDWARE_TLS)])?
            }
            UcxExposure::HardwareOnly => Context::new()?,
            UcxExposure::TrustedNetwork { net_devices } => {
                Context::with_settings(&[("NET_DEVICES", net_devices)])?
            }
        };
        let resources = ctx.resources()?;
        match (&setup.exposure, resources.check_hardware_rma()) {
            (_, Ok(())) => {}
            (UcxExposure::HardwareOnly, Err(soft)) => return Err(UcxStartError::SoftwareRma(soft)),
            (UcxExposure::TrustedNetwork { .. }, Err(soft)) => tracing::warn!(
                transports = %list(&soft),
                "UCX SERVES REMOTE MEMORY ACCESS IN SOFTWARE (--peer-ucx-insecure-software-rma): every process \
                 that reaches these transports can read and overwrite this daemon's DRAM tier and crash it"
            ),
        }
        let (serving, exposed) = if setup.serve {
            let exposed = Self::map(&ctx, store, Access::RemoteRead)?;
            (Some(Progress::start(&ctx, "kvnode-ucx")?), Some(exposed))
        } else {
            (None, None)
        };
        let landing = Self::map(&ctx, store, Access::Local)?;
        Ok(Self {
            serving,
            exposed: RwLock::new(exposed),
            landing: Arc::new(landing),
            generation: AtomicU64::new(1),
            window: setup.window.max(1),
            max_in_flight: AtomicUsize::new(0),
            resources,
            ctx,
            store: Arc::clone(store),
        })
    }

    /// Registers the arena: `RemoteRead` for the registration whose key peers get (never
    /// remote-writable), `Local` for the one GETs land in (no key is ever packed from it).
    fn map(ctx: &Context, store: &Arc<Store>, access: Access) -> Result<Region, UcxError> {
        let arena = store.arena();
        // SAFETY: the arena stays mapped while `store` lives, and every holder of the
        // region (this node, each UCX connection) also holds the store.
        unsafe {
            Region::map(
                ctx,
                arena.base(),
                arena.len() as usize,
                MemoryKind::Host,
                access,
            )
        }
    }

    /// The key generation now in force (raised by [`UcxNode::reregister`]).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The most GETs one connection of this daemon has had in flight at once.
    pub fn max_gets_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::Relaxed)
    }

    /// What a destination needs to read this arena, and the generation it belongs to;
    /// `None` when this daemon serves no pulls.
    pub fn offer(&self) -> Result<Option<(PeerMsg, u64)>, UcxError> {
        let g = self.exposed.read().expect("ucx region lock");
        let (Some(region), Some(serving)) = (g.as_ref(), &self.serving) else {
            return Ok(None);
        };
        let gen_now = self.generation();
        let rkey = region.pack_rkey()?;
        Ok(Some((
            PeerMsg::UcxOffer {
                worker: serving.address().0.clone(),
                rkey: rkey.0,
                base: region.base(),
                len: region.len() as u64,
            },
            gen_now,
        )))
    }

    /// Revokes every key handed out: registers the arena afresh (new key) and unmaps the old
    /// registration at once. On verbs the old key stops working then (a GET with it fails);
    /// software transports do not check keys (see docs/peer-protocol.md). Open
    /// connections receive the new key before their next answer. Returns the new generation
    /// (unchanged when this daemon exposes nothing).
    pub fn reregister(&self) -> Result<u64, UcxError> {
        if self.serving.is_none() {
            return Ok(self.generation());
        }
        let fresh = Self::map(&self.ctx, &self.store, Access::RemoteRead)?;
        let mut g = self.exposed.write().expect("ucx region lock");
        let old = g.replace(fresh);
        let gen_now = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        drop(g);
        drop(old); // ucp_mem_unmap: the revocation
        Ok(gen_now)
    }

    /// A reading end to a source that sent `offer` (fields of [`PeerMsg::UcxOffer`]).
    pub fn connect(
        &self,
        worker: &[u8],
        rkey: &[u8],
        base: u64,
        len: u64,
    ) -> Result<UcxPeer, UcxError> {
        let remote = Remote::connect(
            &self.ctx,
            &WorkerAddress(worker.to_vec()),
            &PackedRkey(rkey.to_vec()),
            Arc::clone(&self.landing),
        )?;
        Ok(UcxPeer {
            remote,
            base,
            len,
            _store: Arc::clone(&self.store),
        })
    }

    /// One line for the start-up log (no key material).
    pub fn describe(&self) -> String {
        let r = &self.landing;
        let what = if self.serving.is_some() {
            "registered for one-sided reads by peers (remote read only)"
        } else {
            "registered for landing pulls only (no peer listener: nothing exposed, no serving worker)"
        };
        format!(
            "UCX {} ready over {}: {} arena bytes {what}",
            Context::version(),
            list(&self.resources.0),
            r.len()
        )
    }
}

/// The destination's UCX endpoint to one source and the bounds of the source's arena.
#[derive(Debug)]
pub struct UcxPeer {
    /// Declared before `_store`: dropped (endpoint closed, local region released) first.
    remote: Remote,
    base: u64,
    len: u64,
    _store: Arc<Store>,
}

/// The destination's end of a UCX connection: frames on TCP, block bytes by GET.
#[derive(Debug)]
pub struct UcxPull {
    tcp: TcpPull,
    peer: UcxPeer,
    /// Connect arguments for a key handed over mid-connection.
    node: Arc<UcxNode>,
}

impl UcxPull {
    /// Pairs an authenticated TCP pulling end with its UCX endpoint.
    pub fn new(tcp: TcpPull, peer: UcxPeer, node: Arc<UcxNode>) -> Self {
        Self { tcp, peer, node }
    }
}

impl SlotReads for UcxPull {
    /// GETs this connection may keep in flight.
    fn window(&self) -> usize {
        self.node.window
    }

    /// GETs posted and not yet landed or abandoned.
    fn in_flight(&self) -> usize {
        self.peer.remote.in_flight()
    }

    /// Starts a GET of `len` bytes at the source's `addr` into `dst`, known by `tag` until
    /// [`SlotReads::land_one`] reports it.
    ///
    /// # Safety
    /// As [`kvnode_ucx::Remote::post_get`]: `dst..dst + len` stays valid and untouched until
    /// the GET is landed, or given back by [`SlotReads::abandon`] (never reused if kept).
    unsafe fn post(
        &mut self,
        dst: *mut u8,
        len: usize,
        addr: u64,
        tag: u64,
    ) -> Result<(), PeerError> {
        let p = &mut self.peer;
        let inside = addr >= p.base
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= p.base + p.len);
        if !inside {
            return Err(Violation::SlotOutsideArena { len }.into());
        }
        // SAFETY: the caller's guarantee, passed on.
        unsafe { p.remote.post_get(dst, len, addr, tag) }.map_err(ucx_error)?;
        let n = p.remote.in_flight();
        self.node.max_in_flight.fetch_max(n, Ordering::Relaxed);
        Ok(())
    }

    /// Waits up to `limit` for some GET in flight to finish: its tag, and its outcome (an
    /// error there is a failed GET whose buffer is quiet). A timeout ([`Stage::Get`]) when none
    /// finished: the caller then abandons them all.
    fn land_one(&mut self, limit: Duration) -> Result<(u64, Result<(), PeerError>), PeerError> {
        match self.peer.remote.land_one(limit) {
            Some((tag, r)) => Ok((tag, r.map_err(ucx_error))),
            None => Err(PeerError::timeout(Stage::Get, limit)),
        }
    }

    /// Cancels every GET in flight and closes the endpoint; waits up to `limit` for UCX to
    /// hand them back. Returns the tags of those it kept: their buffers may still be written
    /// and must be retired, never reused.
    fn abandon(&mut self, limit: Duration) -> Vec<u64> {
        self.peer.remote.abandon(limit)
    }

    /// Takes a new key (and worker address) the source sent after re-registering.
    fn rekey(&mut self, worker: &[u8], rkey: &[u8], base: u64, len: u64) -> Result<(), PeerError> {
        if self.in_flight() != 0 {
            return Err(Violation::RekeyInFlight.into());
        }
        self.peer = self
            .node
            .connect(worker, rkey, base, len)
            .map_err(WireError::Get)?;
        Ok(())
    }
}

fn ucx_error(e: UcxError) -> PeerError {
    match e {
        UcxError::Timeout { limit, .. } => PeerError::timeout(Stage::Get, limit),
        UcxError::Stuck { .. } => PullError::GetStuck(e).into(),
        e => WireError::Get(e).into(),
    }
}

impl PullConn for UcxPull {
    type Slots = Self;

    fn remote(&self) -> SocketAddr {
        self.tcp.remote()
    }

    fn send_early(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        self.tcp.send_early(msgs)
    }

    fn block_mac(&self) -> Option<Arc<BlockMac>> {
        self.tcp.block_mac()
    }

    fn slots(&mut self) -> Option<&mut Self> {
        Some(self)
    }

    fn send_all(&mut self, msgs: &[PeerMsg], limit: Duration) -> Result<(), PeerError> {
        self.tcp.send_all(msgs, limit)
    }

    fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        self.tcp.recv(limit)
    }

    fn read_payload(&mut self, _dst: &mut [u8], _limit: Duration) -> Result<(), PeerError> {
        Err(Violation::BodyOnUcx.into())
    }

    fn open_payload(&mut self, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        self.tcp.open_payload(body, seal)
    }

    fn encrypted(&self) -> bool {
        self.tcp.encrypted()
    }

    fn key_id(&self) -> Option<u64> {
        self.tcp.key_id()
    }
}
