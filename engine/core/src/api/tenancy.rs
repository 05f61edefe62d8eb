//! Who may connect, and what a connection's tenant may name.
//!
//! At accept: `SO_PEERCRED` against `allow_uids` / `allow_gids`, then the tenant map. A
//! refused client gets `Error { Handshake }` with the reason in answer to its `Hello` (so it
//! reads why), the refusal is logged with pid, uid and gid and counted in
//! `kvnode_clients_refused_total{reason}`.
//!
//! Per request: a namespace handle is usable only by the tenant that registered it (any other
//! handle answers exactly like one that does not exist, so handles cannot be probed),
//! `Register` mixes the client's `tenant_salt` under the tenant's, `Clear` of everything clears
//! the caller's tenant (everything for the operator: root or the daemon's uid), `Stats` shows
//! other tenants' rows only to the operator,
//! and without the arena mapping (`share_arena = false`) `Alloc` is refused: its slots are
//! filled through the mapping, and committing one unwritten would publish whatever bytes the
//! slot last held. Inline gets, puts, regions and GPU ops need no mapping; a lease-mode get
//! still answers extents and pins the blocks (SGLang checks presence that way), which shows
//! nothing without the mapping.

use kvnode_fdpass::PeerCred;
use kvnode_proto::client::{ErrorCode, Op, Reply};
use kvnode_proto::stats::StatsReport;

use super::errors::error;
use super::session::Session;
use crate::config::EngineConfig;
use crate::dram::TierError;
use crate::obs::Refusal;
use crate::tenant::{NoTenant, TenantId, Tenants};

/// Admission of a new connection: its identity and tenant, or why it is refused.
pub(super) type Admission = Result<TenantId, (Refusal, String)>;

/// Decides whether a client may connect and which tenant it is.
pub(super) fn admit(
    cfg: &EngineConfig,
    tenants: &Tenants,
    cred: &std::io::Result<PeerCred>,
) -> Admission {
    let lists = !cfg.allow_uids.is_empty() || !cfg.allow_gids.is_empty();
    let cred = match cred {
        Ok(c) => *c,
        Err(e) if lists || tenants.enabled() => {
            let why =
                format!("cannot read the client's SO_PEERCRED ({e}); access control needs it");
            return Err((Refusal::NoCredentials, why));
        }
        Err(_) => return Ok(0),
    };
    if lists && !cfg.allow_uids.contains(&cred.uid) && !cfg.allow_gids.contains(&cred.gid) {
        let why = format!(
            "uid {} gid {} is not allowed to connect (not in allow_uids / allow_gids)",
            cred.uid, cred.gid
        );
        return Err((Refusal::Allowlist, why));
    }
    tenants
        .resolve(cred.uid, cred.gid)
        .map_err(|NoTenant::Unmapped| {
            let why = format!(
                "uid {} gid {} belongs to no tenant and [tenants] unmapped = \"refuse\"",
                cred.uid, cred.gid
            );
            (Refusal::Unmapped, why)
        })
}

/// The namespace handle an op names, if any. Every variant is listed: a new op must say
/// whether it names a namespace before it compiles.
fn op_ns(op: &Op) -> Option<u32> {
    match op {
        Op::Put { ns, .. }
        | Op::Alloc { ns, .. }
        | Op::Get { ns, .. }
        | Op::Exists { ns, .. }
        | Op::Delete { ns, .. }
        | Op::Touch { ns, .. }
        | Op::Pull { ns, .. }
        | Op::Act { ns, .. }
        | Op::GetToRegion { ns, .. }
        | Op::PutFromRegion { ns, .. } => Some(*ns),
        Op::Clear { ns } => *ns,
        Op::Offload(m) | Op::Onload(m) | Op::OnloadAsync(m) => Some(m.ns),
        Op::Hello { .. }
        | Op::Register { .. }
        | Op::Commit { .. }
        | Op::Abort { .. }
        | Op::Release { .. }
        | Op::Stats
        | Op::Cluster
        | Op::Wait { .. }
        | Op::Cancel { .. }
        | Op::Timeouts
        | Op::Histograms
        | Op::AttachRegion { .. }
        | Op::DetachRegion { .. }
        | Op::AttachGpu(_)
        | Op::OnloadWait { .. }
        | Op::OnloadCancel { .. }
        | Op::OnloadLayerWait { .. } => None,
    }
}

impl Session {
    /// The refusal of an op this connection's tenant may not make, if any.
    pub(super) fn tenancy_refusal(&self, op: &Op) -> Option<Reply> {
        let tenants = self.engine.tenants();
        if !tenants.enabled() {
            return None;
        }
        if let Some(ns) = op_ns(op)
            && !tenants.owns(self.tenant, ns)
        {
            // Word for word what a handle that does not exist gets.
            let e = TierError::UnknownNamespace(ns);
            return Some(error(ErrorCode::UnknownNamespace, e.to_string()));
        }
        let t = tenants.get(self.tenant);
        if matches!(op, Op::Alloc { .. }) && !t.share_arena {
            let msg = format!(
                "tenant {:?} is not given the arena mapping (share_arena = false), so it cannot \
                 fill allocated slots: use Put, regions or GPU ops",
                t.name
            );
            return Some(error(ErrorCode::Unsupported, msg));
        }
        None
    }

    /// `Clear` of everything under a tenant map: every namespace of the caller's tenant.
    pub(super) fn clear_own(&self) -> Reply {
        let store = &self.engine.store;
        let mut count = 0;
        for h in self.engine.tenants().handles(self.tenant) {
            match store.clear(Some(h)) {
                Ok(n) => count += n,
                Err(e) => return super::errors::tier_error(&e),
            }
        }
        tracing::info!(
            conn = self.id,
            tenant = self.tenant,
            count,
            "cleared the tenant's namespaces"
        );
        Reply::Cleared { count }
    }

    /// Whether this client is the node's operator: root or the daemon's own uid. Under a
    /// tenant map it alone sees every tenant in `stats` and clears every tenant with `Clear`
    /// of everything.
    pub(super) fn is_operator(&self) -> bool {
        // SAFETY: geteuid has no preconditions.
        let own_uid = unsafe { libc::geteuid() };
        self.cred.uid == 0 || self.cred.uid == own_uid
    }

    /// The stats report as this client may see it: under a tenant map, a tenant other than
    /// the operator sees only its own figures: its namespaces and tenant row, the DRAM
    /// tier's blocks/bytes/hits/misses/inserts/evictions summed over its namespaces, each
    /// tier's capacity and health; node-wide activity (other tiers' counters, slot classes,
    /// clients, regions, refusals) is left out, since it shows what others do.
    pub(super) fn stats_for_caller(&self) -> StatsReport {
        let mut s = self.engine.stats();
        let tenants = self.engine.tenants();
        if !tenants.enabled() || self.is_operator() {
            return s;
        }
        let mine = tenants.handles(self.tenant);
        s.namespaces.retain(|n| mine.contains(&n.ns));
        let name = &tenants.get(self.tenant).name;
        s.tenants.retain(|t| &t.name == name);
        let sum = |f: fn(&kvnode_proto::stats::NamespaceStats) -> u64| {
            s.namespaces.iter().map(f).sum::<u64>()
        };
        let own = (
            sum(|n| n.blocks),
            sum(|n| n.bytes),
            sum(|n| n.hits),
            sum(|n| n.misses),
            sum(|n| n.inserts),
            sum(|n| n.evictions),
        );
        for t in &mut s.tiers {
            let dram = t.tier == "dram";
            *t = kvnode_proto::stats::TierStats {
                tier: std::mem::take(&mut t.tier),
                capacity_bytes: t.capacity_bytes,
                pinned_bytes: t.pinned_bytes,
                populated_bytes: t.populated_bytes,
                pin_refused: t.pin_refused,
                poisoned: t.poisoned.take(),
                ..Default::default()
            };
            if dram {
                (t.blocks, t.bytes, t.hits, t.misses, t.inserts, t.evictions) = own;
            }
        }
        s.pools.clear();
        s.clients = 0;
        s.regions = kvnode_proto::stats::RegionStats::default();
        s.refused = kvnode_proto::stats::RefusedStats::default();
        // Node-wide event activity (every publishing tenant's stores and drops).
        s.events = None;
        s
    }

    /// `Histograms`: node-wide latencies of every tenant's ops, so under a tenant map only
    /// the operator reads them.
    pub(super) fn histograms_for_caller(&self) -> Reply {
        if self.engine.tenants().enabled() && !self.is_operator() {
            return error(
                ErrorCode::Unsupported,
                "latency histograms are node-wide (every tenant's ops): under a tenant map only the operator (root or the daemon's uid) may read them",
            );
        }
        Reply::Histograms(Box::new(self.engine.metrics.report()))
    }
}

impl Session {
    /// The spec to register for this client: its `tenant_salt` mixed under its tenant's.
    pub(super) fn scoped(&self, spec: &kvnode_proto::NamespaceSpec) -> kvnode_proto::NamespaceSpec {
        self.engine.tenants().scoped_spec(self.tenant, spec)
    }
}
