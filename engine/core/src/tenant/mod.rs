//! Tenants: who a client is (uid/gid from `SO_PEERCRED`), which namespaces are its, and
//! what it may hold.
//!
//! ```text
//!  accept ─> SO_PEERCRED ─> Tenants::resolve ─> TenantId (or refused at accept)
//!  Register{spec} ─> Tenants::scoped_spec: tenant_salt = "kvnode-tenant:<name>[/<client salt>]"
//!                 ─> store.register ─> Tenants::bind(ns handle, namespace id, tenant)
//!  every op naming a handle ─> Tenants::owns(tenant, ns)?   (else: unknown namespace)
//!  Store::reserve ─> Tenants::dram_scope ─> quota (evict the tenant's own blocks first)
//!  demotion ─> nvme ledger ─> Tenants::nvme_quota (drop the tenant's oldest NVMe blocks first)
//!  accept / AttachRegion / AttachGpu / lease-mode Get / OnloadAsync
//!        ─> Tenants::charge(uid, what, n) against the tenant's per-uid caps (limits.rs,
//!           usage.rs) ─> Charge (RAII) or OverCap (LimitReached to the client)
//! ```
//!
//! The daemon, not the client, chooses the tenant part of the salt, so a client cannot name
//! another tenant's namespace: whatever `tenant_salt` it sends is mixed *under* its own
//! tenant's (it can narrow, e.g. vLLM's `cache_salt`, never widen). The salt is derived from
//! the tenant's name only, so every daemon with the same map derives the same namespace ids:
//! a peer pull travels with the id and hits within a tenant, and misses across tenants.
//!
//! Without a map (no `[[tenants.tenant]]`) there is one tenant, the client's salt is used as
//! given, every handle is everyone's and nothing is charged: the behaviour before tenants.
//! This module imports nothing from the crate but its config helpers.

pub mod config;
pub mod limits;
pub mod usage;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, PoisonError, RwLock};

use kvnode_proto::stats::TenantStats;
use kvnode_proto::{NamespaceId, NamespaceSpec};

pub use config::{TenantConfigError, TenantSettings, TenantsConfig, Unmapped};
pub use limits::{Caps, ClientLimits};
pub use usage::{Charge, Held, OverCap};

/// Index of a tenant in the map (0 is the only tenant without a map).
pub type TenantId = u16;

/// Prefix of every daemon-derived tenant salt.
pub const SALT_PREFIX: &str = "kvnode-tenant:";

/// Why a client identity gets no tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoTenant {
    /// Its uid and gid are in no tenant and `unmapped = "refuse"`.
    Unmapped,
}

/// One tenant's settings and counters.
#[derive(Debug)]
pub struct Tenant {
    /// Name from the config.
    pub name: String,
    /// The salt the daemon puts in front of every namespace of this tenant.
    pub salt: String,
    /// DRAM quota in bytes.
    pub dram_quota: Option<u64>,
    /// NVMe quota in bytes.
    pub nvme_quota: Option<u64>,
    /// Retained (`kv.retain`) quota in bytes, if set.
    pub retain_quota: Option<u64>,
    /// Whether its clients get the arena memfd.
    pub share_arena: bool,
    /// Own DRAM blocks evicted to stay within the DRAM quota.
    pub dram_quota_evictions: AtomicU64,
    /// Own NVMe blocks dropped to stay within the NVMe quota.
    pub nvme_quota_evictions: AtomicU64,
    /// Bytes of DRAM slots reserved for this tenant and not yet committed or aborted (kept
    /// only when it has a DRAM quota; counted against it).
    pub dram_reserved: AtomicU64,
    /// Keys refused `NoSpace` by the DRAM quota (nothing of the tenant's could be evicted).
    pub quota_refusals: AtomicU64,
    /// Bytes of this tenant's blocks on NVMe (kept by the NVMe tier's ledger).
    pub nvme_bytes: AtomicU64,
    /// Bytes of router metadata its blocks hold outside the arena (charged by
    /// `residency::MetaCharge`, bounded in `api/meta.rs`).
    pub meta_bytes: Arc<AtomicU64>,
    /// Its per-uid caps (`[tenants.limits]`, overridden by its own `limits`).
    pub caps: Caps,
    /// Held now by its clients, by [`Held`] index (usage.rs).
    pub held: [AtomicU64; 3],
    /// Requests (and connections) of its clients refused at a per-uid cap, by [`Held`].
    pub limit_refusals: [AtomicU64; 3],
}

impl Tenant {
    /// Its per-uid cap on `what`.
    pub fn cap(&self, what: Held) -> u64 {
        match what {
            Held::Connections => u64::from(self.caps.connections),
            Held::Regions => u64::from(self.caps.regions),
            Held::LeasedBlocks => self.caps.leased_blocks,
        }
    }
}

#[derive(Debug, Default)]
struct Bound {
    by_ns: HashMap<u32, TenantId>,
    by_id: HashMap<NamespaceId, TenantId>,
    /// Handles of each tenant, in registration order.
    handles: Vec<Vec<u32>>,
}

/// The tenant map in force and which namespace is whose.
#[derive(Debug)]
pub struct Tenants {
    enabled: bool,
    unmapped: Unmapped,
    list: Vec<Tenant>,
    by_uid: HashMap<u32, TenantId>,
    by_gid: HashMap<u32, TenantId>,
    default: Option<TenantId>,
    bound: RwLock<Bound>,
    usage: usage::Usage,
}

fn tenant(s: &TenantSettings, base: ClientLimits, nofile: u64) -> Tenant {
    Tenant {
        name: s.name.clone(),
        salt: format!("{SALT_PREFIX}{}", s.name),
        dram_quota: s.dram_quota,
        nvme_quota: s.nvme_quota,
        retain_quota: s.retain_quota,
        share_arena: s.share_arena,
        dram_quota_evictions: AtomicU64::new(0),
        nvme_quota_evictions: AtomicU64::new(0),
        dram_reserved: AtomicU64::new(0),
        quota_refusals: AtomicU64::new(0),
        nvme_bytes: AtomicU64::new(0),
        meta_bytes: Arc::new(AtomicU64::new(0)),
        caps: s.limits.or(base).caps(nofile),
        held: Default::default(),
        limit_refusals: Default::default(),
    }
}

impl Tenants {
    /// No map: one tenant (`default`), today's behaviour.
    pub fn single() -> Self {
        Self::new(&TenantsConfig::default())
    }

    /// The map of a validated `[tenants]` section; caps left to their defaults follow the
    /// daemon's descriptor limit.
    pub fn new(cfg: &TenantsConfig) -> Self {
        let nofile = limits::fd_hard_limit();
        let base = cfg.limits;
        let mut list: Vec<Tenant> = cfg.tenant.iter().map(|t| tenant(t, base, nofile)).collect();
        let mut default = list.iter().position(|t| t.name == config::DEFAULT_TENANT);
        if default.is_none() && (cfg.unmapped == Unmapped::Default || !cfg.enabled()) {
            let settings = TenantSettings {
                name: config::DEFAULT_TENANT.into(),
                share_arena: !cfg.enabled(),
                ..TenantSettings::default()
            };
            list.push(tenant(&settings, base, nofile));
            default = Some(list.len() - 1);
        }
        let default = if cfg.unmapped == Unmapped::Default {
            default.map(|d| d as TenantId)
        } else {
            None
        };
        let mut by_uid = HashMap::new();
        let mut by_gid = HashMap::new();
        for (i, t) in cfg.tenant.iter().enumerate() {
            by_uid.extend(t.uids.iter().map(|&u| (u, i as TenantId)));
            by_gid.extend(t.gids.iter().map(|&g| (g, i as TenantId)));
        }
        let handles = vec![Vec::new(); list.len()];
        Self {
            enabled: cfg.enabled(),
            unmapped: cfg.unmapped,
            list,
            by_uid,
            by_gid,
            default,
            bound: RwLock::new(Bound {
                handles,
                ..Bound::default()
            }),
            usage: usage::Usage::default(),
        }
    }

    /// Whether a map is configured (else one tenant and no checks).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// What unmapped identities get.
    pub fn unmapped(&self) -> Unmapped {
        self.unmapped
    }

    /// The tenant of a client identity: its uid's, else its gid's, else the default one.
    pub fn resolve(&self, uid: u32, gid: u32) -> Result<TenantId, NoTenant> {
        if !self.enabled {
            return Ok(0);
        }
        self.by_uid
            .get(&uid)
            .or_else(|| self.by_gid.get(&gid))
            .copied()
            .or(self.default)
            .ok_or(NoTenant::Unmapped)
    }

    /// A tenant by id.
    pub fn get(&self, t: TenantId) -> &Tenant {
        &self.list[usize::from(t)]
    }

    /// The spec a client of tenant `t` registers: its `tenant_salt` mixed under the
    /// tenant's. Without a map the spec is unchanged.
    pub fn scoped_spec(&self, t: TenantId, spec: &NamespaceSpec) -> NamespaceSpec {
        if !self.enabled {
            return spec.clone();
        }
        let own = &self.get(t).salt;
        let tenant_salt = if spec.tenant_salt.is_empty() {
            own.clone()
        } else {
            // Tenant names have no '/', so (tenant, client salt) is recoverable: injective.
            format!("{own}/{}", spec.tenant_salt)
        };
        NamespaceSpec {
            tenant_salt,
            ..spec.clone()
        }
    }

    fn bound(&self) -> std::sync::RwLockReadGuard<'_, Bound> {
        self.bound.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that handle `ns` (namespace `id`) belongs to tenant `t`.
    pub fn bind(&self, ns: u32, id: NamespaceId, t: TenantId) {
        let mut b = self.bound.write().unwrap_or_else(PoisonError::into_inner);
        if b.by_ns.insert(ns, t).is_none() {
            b.handles[usize::from(t)].push(ns);
        }
        b.by_id.insert(id, t);
    }

    /// Whether a client of tenant `t` may name handle `ns` (always, without a map).
    pub fn owns(&self, t: TenantId, ns: u32) -> bool {
        !self.enabled || self.bound().by_ns.get(&ns) == Some(&t)
    }

    /// The handles of tenant `t`.
    pub fn handles(&self, t: TenantId) -> Vec<u32> {
        self.bound()
            .handles
            .get(usize::from(t))
            .cloned()
            .unwrap_or_default()
    }

    /// The tenant a handle belongs to.
    pub fn of_handle(&self, ns: u32) -> Option<TenantId> {
        self.bound().by_ns.get(&ns).copied()
    }

    /// The tenant a namespace id belongs to.
    pub fn of_id(&self, id: NamespaceId) -> Option<TenantId> {
        self.bound().by_id.get(&id).copied()
    }

    /// For a reservation in handle `ns`: its tenant, the tenant's handles and DRAM quota,
    /// when that tenant has a DRAM quota.
    pub fn dram_scope(&self, ns: u32) -> Option<(TenantId, Vec<u32>, u64)> {
        let b = self.bound();
        let t = *b.by_ns.get(&ns)?;
        let quota = self.get(t).dram_quota?;
        Some((t, b.handles[usize::from(t)].clone(), quota))
    }

    /// The tenant of handle `ns` when it has a DRAM quota.
    pub fn dram_quota_tenant(&self, ns: u32) -> Option<&Tenant> {
        let t = self.get(self.of_handle(ns)?);
        t.dram_quota.is_some().then_some(t)
    }

    /// Number of tenants.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Always false: there is at least one tenant or a refusing map.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// One row per tenant; `dram_bytes_of(handle)` gives a namespace's DRAM bytes.
    pub fn report(&self, dram_bytes_of: impl Fn(u32) -> u64) -> Vec<TenantStats> {
        let b = self.bound();
        self.list
            .iter()
            .enumerate()
            .map(|(i, t)| TenantStats {
                name: t.name.clone(),
                namespaces: b.handles[i].len() as u32,
                dram_bytes: b.handles[i].iter().map(|&h| dram_bytes_of(h)).sum(),
                dram_quota: t.dram_quota.unwrap_or(0),
                nvme_bytes: t.nvme_bytes.load(Relaxed),
                nvme_quota: t.nvme_quota.unwrap_or(0),
                dram_quota_evictions: t.dram_quota_evictions.load(Relaxed),
                nvme_quota_evictions: t.nvme_quota_evictions.load(Relaxed),
                quota_refusals: t.quota_refusals.load(Relaxed),
                share_arena: t.share_arena,
                connections: t.held[Held::Connections as usize].load(Relaxed),
                regions: t.held[Held::Regions as usize].load(Relaxed),
                leased_blocks: t.held[Held::LeasedBlocks as usize].load(Relaxed),
                refused_connections: t.limit_refusals[Held::Connections as usize].load(Relaxed),
                refused_regions: t.limit_refusals[Held::Regions as usize].load(Relaxed),
                refused_leases: t.limit_refusals[Held::LeasedBlocks as usize].load(Relaxed),
                connections_per_uid: t.caps.connections,
                regions_per_uid: t.caps.regions,
                leased_blocks_per_uid: t.caps.leased_blocks,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
