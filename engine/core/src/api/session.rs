//! The state one client connection owns, and the reply path. Request handlers (dispatch,
//! data, hinted, region, gpu) are `impl Session` blocks in their own files; none imports
//! another, and this file imports none of them.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::Arc;

use kvnode_fdpass::PeerCred;
use kvnode_proto::client::{Reply, Response};
use kvnode_proto::frame::encode_frame;

use super::gpu_conn::GpuConn;
use super::io::SockIo;
use super::region_copy::Region;
use crate::engine::Engine;
use crate::obs::{ConnWatch, ReplyInfo};
use crate::residency::RouterMeta;
use crate::store::{Lease, Reservation};
use crate::tenant::{Charge, Held, OverCap, TenantId};

/// The blocks of one lease id, and their charge under the uid's `leased_blocks_per_uid`.
#[derive(Debug)]
pub(super) struct HeldLease {
    pub blocks: Vec<Lease>,
    pub _charge: Charge,
}

/// State owned by one connection. Everything it holds is released when it drops.
#[derive(Debug)]
pub(super) struct Session {
    pub engine: Arc<Engine>,
    pub io: SockIo,
    pub id: u64,
    pub cred: PeerCred,
    /// The client's tenant (0 without a tenant map).
    pub tenant: TenantId,
    /// Lease id -> leased blocks (released when removed).
    pub leases: HashMap<u64, HeldLease>,
    /// Alloc handle -> reservation (aborted when removed uncommitted).
    pub reservations: HashMap<u64, Reservation>,
    pub next_handle: u64,
    /// Op in flight and lease ages, read by the stall watchdog.
    pub watch: Arc<ConnWatch>,
    /// What the last reply sent said (status, bytes), for the op's probe and histograms.
    pub reply_info: ReplyInfo,
    /// Region id -> client memory mapped by `AttachRegion` (unmapped on drop).
    pub regions: HashMap<u32, Region>,
    pub next_region: u32,
    /// Attached GPU buffers and pending onloads.
    pub gpu: GpuConn,
    /// This connection under its uid's `connections_per_uid` (given back when it drops).
    _conn: Charge,
}

impl Session {
    pub fn new(
        engine: Arc<Engine>,
        io: SockIo,
        cred: PeerCred,
        tenant: TenantId,
        conn: Charge,
    ) -> Self {
        let id = engine.client_connected();
        let watch = engine.metrics.watch.add(id);
        Self {
            engine,
            io,
            id,
            cred,
            tenant,
            leases: HashMap::new(),
            reservations: HashMap::new(),
            next_handle: 1,
            watch,
            reply_info: ReplyInfo::default(),
            regions: HashMap::new(),
            next_region: 0,
            gpu: GpuConn::default(),
            _conn: conn,
        }
    }

    /// Charges `n` of `what` to this client's uid, or says (to log and to the client) why
    /// not: the uid is at its cap. Counted per tenant and in `kvnode_clients_refused_total`.
    pub fn charge(&self, what: Held, n: u64) -> Result<Charge, OverCap> {
        let r = self
            .engine
            .tenants()
            .charge(self.cred.uid, self.tenant, what, n);
        if let Err(over) = &r {
            self.engine
                .metrics
                .client_refused(crate::obs::Refusal::over(what));
            tracing::warn!(conn = self.id, pid = self.cred.pid, reason = %over, "request refused at a per-uid cap");
        }
        r
    }

    /// A fresh handle (lease id, alloc handle, onload ticket) unique on this connection.
    pub fn next_id(&mut self) -> u64 {
        let h = self.next_handle;
        self.next_handle += 1;
        h
    }

    /// Keeps a reservation under a fresh alloc handle.
    pub fn hold(&mut self, mut r: Reservation, meta: Option<Arc<RouterMeta>>) -> u64 {
        r.set_meta(meta);
        let h = self.next_id();
        self.reservations.insert(h, r);
        h
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

    /// Sends a reply header whose `total` payload bytes the caller writes next with
    /// [`SockIo::write_all`] (a streamed get).
    pub async fn send_head(&mut self, id: u64, reply: Reply, total: u64) -> std::io::Result<()> {
        self.reply_info = self.engine.metrics.reply(&reply, total);
        let frame = encode_frame(&Response { id, reply }, total)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        self.io.write_all(&mut [IoSlice::new(&frame)]).await
    }

    /// Releases every lease and reservation this connection still holds (ops filling its
    /// buffers are fenced first, so no byte lands in a freed slot).
    pub fn release_all(&mut self) {
        let back = self.engine.peers.cancel_conn(self.id);
        self.reservations.extend(back);
        let leases: usize = self.leases.values().map(|l| l.blocks.len()).sum();
        let reservations = self.reservations.len();
        self.watch.leases_end();
        if leases > 0 || reservations > 0 {
            tracing::info!(
                conn = self.id,
                leases,
                reservations,
                "released what the client held"
            );
        }
        self.leases.clear();
        self.reservations.clear();
        self.regions.clear();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.release_all();
        self.engine.metrics.watch.remove(self.id);
        self.engine.client_disconnected();
    }
}
