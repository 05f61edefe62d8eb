//! What each client uid holds now (connections, attached regions, leased blocks), charged
//! against its tenant's per-uid [`Caps`](super::limits::Caps) and given back by RAII.
//!
//! ```text
//!  accept ─> Tenants::charge(uid, Connections, 1) ─> Charge (in the session; drop: -1)
//!  AttachRegion / AttachGpu ─> charge(Regions, 1) ─> Charge (in the region / buffer)
//!  lease-mode Get, OnloadAsync ─> charge(LeasedBlocks, keys) ─> shrink to what was leased
//!                                 ─> Charge (beside the leases; dropped with them)
//!  over the cap ─> OverCap (the client gets Error { LimitReached }; counted per tenant)
//! ```
//!
//! The table holds one entry per uid holding anything (an entry goes when its counts reach
//! zero), so its size is bounded by the uids connected.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};

use super::{TenantId, Tenants};

/// What a cap counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Open client connections.
    Connections = 0,
    /// Attached client regions and GPU buffers.
    Regions = 1,
    /// Blocks held leased by the client.
    LeasedBlocks = 2,
}

impl Held {
    /// Every kind, in index order.
    pub const ALL: [Held; 3] = [Held::Connections, Held::Regions, Held::LeasedBlocks];

    /// The config field that sets its cap.
    pub fn field(self) -> &'static str {
        match self {
            Held::Connections => "connections_per_uid",
            Held::Regions => "regions_per_uid",
            Held::LeasedBlocks => "leased_blocks_per_uid",
        }
    }

    /// What the client should do about it.
    fn advice(self) -> &'static str {
        match self {
            Held::Connections => "close connections it does not use",
            Held::Regions => "detach regions (or close connections holding GPU buffers)",
            Held::LeasedBlocks => "release leases (or wait for async onloads)",
        }
    }

    /// The label of its refusals in `kvnode_clients_refused_total` and its row in `stats`.
    pub fn label(self) -> &'static str {
        match self {
            Held::Connections => "connections",
            Held::Regions => "regions",
            Held::LeasedBlocks => "leased_blocks",
        }
    }
}

/// Per-uid counts.
#[derive(Debug, Default)]
pub struct Usage {
    by_uid: Mutex<HashMap<u32, [u64; 3]>>,
}

/// A request that would take a uid past its cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "uid {uid} (tenant {tenant:?}) holds {held} {what} and asks for {n} more, past its cap of {cap} ([tenants.limits] {field}): {advice}, or have the operator raise the cap",
    what = what.label(),
    field = what.field(),
    advice = what.advice()
)]
pub struct OverCap {
    /// The client uid.
    pub uid: u32,
    /// Its tenant's name.
    pub tenant: String,
    /// What was asked for.
    pub what: Held,
    /// Held now.
    pub held: u64,
    /// Asked for.
    pub n: u64,
    /// The cap.
    pub cap: u64,
}

/// `n` of `what` held by one uid, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    tenants: Arc<Tenants>,
    uid: u32,
    tenant: TenantId,
    what: Held,
    n: u64,
}

impl Tenants {
    /// Charges `n` of `what` to `uid` (of `tenant`), unless that passes the tenant's per-uid
    /// cap: then nothing is charged and the refusal is counted on the tenant.
    pub fn charge(
        self: &Arc<Self>,
        uid: u32,
        tenant: TenantId,
        what: Held,
        n: u64,
    ) -> Result<Charge, OverCap> {
        let t = self.get(tenant);
        let cap = t.cap(what);
        let mut m = self
            .usage
            .by_uid
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let held = m.get(&uid).map_or(0, |c| c[what as usize]);
        if held.saturating_add(n) > cap {
            drop(m);
            t.limit_refusals[what as usize].fetch_add(1, Relaxed);
            return Err(OverCap {
                uid,
                tenant: t.name.clone(),
                what,
                held,
                n,
                cap,
            });
        }
        m.entry(uid).or_default()[what as usize] += n;
        t.held[what as usize].fetch_add(n, Relaxed);
        Ok(Charge {
            tenants: Arc::clone(self),
            uid,
            tenant,
            what,
            n,
        })
    }

    /// What `uid` holds now, by [`Held`] index.
    pub fn held_by_uid(&self, uid: u32) -> [u64; 3] {
        let m = self
            .usage
            .by_uid
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        m.get(&uid).copied().unwrap_or_default()
    }

    fn give_back(&self, uid: u32, tenant: TenantId, what: Held, n: u64) {
        if n == 0 {
            return;
        }
        let mut m = self
            .usage
            .by_uid
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = m.get_mut(&uid) {
            c[what as usize] = c[what as usize].saturating_sub(n);
            if c.iter().all(|&x| x == 0) {
                m.remove(&uid);
            }
        }
        drop(m);
        self.get(tenant).held[what as usize].fetch_sub(n, Relaxed);
    }
}

impl Charge {
    /// Gives back all but `keep` (a holding request charged for every key it named, and
    /// leased fewer).
    pub fn shrink(&mut self, keep: u64) {
        if keep < self.n {
            let back = self.n - keep;
            self.n = keep;
            self.tenants
                .give_back(self.uid, self.tenant, self.what, back);
        }
    }

    /// How many it holds.
    pub fn n(&self) -> u64 {
        self.n
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.tenants
            .give_back(self.uid, self.tenant, self.what, self.n);
    }
}
