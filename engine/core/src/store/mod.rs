//! The node store: the one owner of the lookup order DRAM → NVMe, of every slot guard, and
//! of every move between the tiers.
//!
//! ```text
//!  client api ─┐                       ┌─> DramTier (index, slot classes, leases, eviction)
//!  peer source ├─> Store ── lookup ────┤
//!  peer fetch  │   lease / exists /    └─> NvmeTier (adapter over kvnode-spill: reads,
//!  gpu ops    ─┘   reserve / delete /        write_block, residencies; knows no DRAM)
//!                  clear
//!  delivery: prefix.rs      every block handed out, in prefix order, window by window
//!  moves:  promote.rs       NVMe -> DRAM, one window of a get at a time (for prefix.rs)
//!          demote.rs        DRAM -> NVMe ahead of need (the demoter task, make_room)
//!          write_behind.rs  DRAM -> NVMe copies that keep the block (`spill.lag`)
//!          flush.rs         DRAM -> NVMe copies at stop (`spill.flush_on_stop_s`), most
//!                           of them while the daemon still serves
//!  lower.rs: the NVMe tier's slot: attached once its index is rebuilt (the store serves
//!            from DRAM meanwhile; deletes and clears made then are applied first)
//! ```
//!
//! Every path that hands a block out goes through [`Store::prefix`] (prefix.rs; [`Store::lease`]
//! is its holding form), and every lookup that only asks through [`Store::locate`] or
//! [`Store::exists`], so a block on this node's NVMe is found the same way by a plain `get`,
//! a hinted `get`, a copy into a region, a peer's pull and a GPU onload. Slots are handed out only as
//! guards ([`Lease`], [`Reservation`]) that release themselves when dropped.
//!
//! Lock order: the DRAM tier's mutex, then the NVMe residency map (taken inside
//! `finish_demotion`/`finish_copy` callbacks, and alone by `forget`), then the spill crate's
//! own locks. No lock is held across an await; block bytes move outside every lock.

mod demote;
mod flush;
mod guard;
mod intent;
mod lower;
mod prefix;
mod promote;
mod quota;
mod write_behind;

use std::sync::Arc;

use kvnode_proto::client::{CommitStatus, PutStatus};
use kvnode_proto::peer::PeerMeta;
use kvnode_proto::stats::TierStats;
use kvnode_proto::{Key, NamespaceId, NamespaceSpec};

use crate::arena::Arena;
use crate::dram::{DramTier, Registered, TierError, TierSnapshot};
use crate::nvme::NvmeTier;
use crate::residency::{Announcer, MetaBudget, RouterMeta};
use crate::tenant::Tenants;

pub use demote::{DemotedNow, spawn_demoter};
pub use flush::{FlushReport, PrecopyReport};
pub use guard::{Lease, Reservation};
pub use lower::SpillPhase;
pub use prefix::{Delivery, Got, Prefix, PrefixLease, Window};
pub use write_behind::spawn_write_behind;

/// Owner id of reservations the store makes itself (promotions from NVMe).
const STORE_OWNER: u64 = 0;

/// Splits blocks of `lens` into consecutive runs of at most `max` bytes (at least one block
/// each), in order.
fn runs(lens: impl Iterator<Item = u64>, max: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut n) = (0, 0u64, 0);
    for (i, l) in lens.enumerate() {
        if i > start && bytes.saturating_add(l) > max {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(l);
        n = i + 1;
    }
    out.push(start..n);
    out
}

/// Where a key lives on this node, in lookup order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// In the DRAM tier.
    Dram,
    /// On NVMe only (a lease promotes it).
    Nvme,
    /// Nowhere on this node.
    Absent,
}

impl Location {
    /// Whether the key is on this node.
    pub fn is_local(self) -> bool {
        self != Location::Absent
    }
}

/// The tiers of one node, with the arena under them and the announcer over them.
#[derive(Debug)]
pub struct Store {
    arena: Arc<Arena>,
    dram: Arc<DramTier>,
    /// The NVMe tier: none, being recovered (lower.rs), or serving.
    nvme: lower::Lower,
    announcer: Arc<Announcer>,
    /// Which namespace is whose, and the quotas reservations are held to.
    tenants: Arc<Tenants>,
}

impl Store {
    /// A store over `arena` with its DRAM tier and, optionally, an NVMe tier under it.
    pub fn new(
        arena: Arc<Arena>,
        dram: Arc<DramTier>,
        nvme: Option<Arc<NvmeTier>>,
        announcer: Arc<Announcer>,
    ) -> Arc<Self> {
        Self::with_tenants(arena, dram, nvme, announcer, Arc::new(Tenants::single()))
    }

    /// Like [`Store::new`], with a tenant map whose quotas reservations are held to.
    pub fn with_tenants(
        arena: Arc<Arena>,
        dram: Arc<DramTier>,
        nvme: Option<Arc<NvmeTier>>,
        announcer: Arc<Announcer>,
        tenants: Arc<Tenants>,
    ) -> Arc<Self> {
        dram.set_has_lower(nvme.is_some());
        Arc::new(Self {
            arena,
            dram,
            nvme: lower::Lower::now(nvme),
            announcer,
            tenants,
        })
    }

    /// Like [`Store::with_tenants`], with an NVMe tier that is being recovered: the store
    /// serves from DRAM until [`Store::attach_nvme`] (or [`Store::nvme_failed`]).
    pub fn recovering(
        arena: Arc<Arena>,
        dram: Arc<DramTier>,
        announcer: Arc<Announcer>,
        tenants: Arc<Tenants>,
    ) -> Arc<Self> {
        dram.set_has_lower(false);
        Arc::new(Self {
            arena,
            dram,
            nvme: lower::Lower::recovering(),
            announcer,
            tenants,
        })
    }

    /// The recovered NVMe tier: deletes and clears made while it recovered are applied to
    /// it, then lookups see it and demotion starts.
    pub fn attach_nvme(&self, tier: Arc<NvmeTier>) {
        self.nvme.attach(tier);
        self.dram.set_has_lower(true);
    }

    /// The NVMe tier's recovery failed: DRAM serves alone.
    pub fn nvme_failed(&self) {
        self.nvme.fail();
    }

    /// Hands the thread recovering the NVMe tier to the store ([`Store::spill_settled`]
    /// joins it).
    pub fn set_nvme_opener(&self, h: std::thread::JoinHandle<()>) {
        self.nvme.set_opener(h);
    }

    /// Where the NVMe tier stands.
    pub fn spill_phase(&self) -> SpillPhase {
        self.nvme.phase()
    }

    /// Waits until the NVMe tier is attached or its recovery failed, and the recovering
    /// thread has ended (it holds the spill files until then).
    pub async fn spill_settled(&self) {
        self.nvme.settled().await;
    }

    /// Runs `f` once the NVMe tier is attached (now, if it is), with `None` when there is
    /// none and will be none.
    pub fn on_nvme_attach(&self, f: impl FnOnce(Option<&Arc<NvmeTier>>) + Send + 'static) {
        self.nvme.on_attach(Box::new(f));
    }

    /// The tenant map.
    pub fn tenants(&self) -> &Arc<Tenants> {
        &self.tenants
    }

    /// The arena every slot lives in.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The DRAM tier (for counters and demotion bookkeeping; blocks go through the store).
    pub fn dram(&self) -> &Arc<DramTier> {
        &self.dram
    }

    /// The NVMe tier, when configured.
    pub fn nvme(&self) -> Option<&Arc<NvmeTier>> {
        self.nvme.get()
    }

    /// The announcer (KV events), for its counters.
    pub fn announcer(&self) -> &Arc<Announcer> {
        &self.announcer
    }

    /// Whether stored blocks are announced to a router (KV events are on).
    pub fn announces(&self) -> bool {
        self.announcer.enabled()
    }

    /// The router-metadata budget of namespace `ns` (its tenant's ledger and limit), or
    /// `None` for an unknown namespace.
    pub fn meta_budget(&self, ns: u32) -> Option<MetaBudget> {
        let spec = self.namespace_spec(ns).ok()?;
        let tenant = self.tenants.get(self.tenants.of_handle(ns)?);
        let dram = self.arena.len();
        let allowance = tenant.dram_quota.unwrap_or(dram).min(dram);
        Some(MetaBudget::new(
            spec,
            tenant.name.clone(),
            Arc::clone(&tenant.meta_bytes),
            allowance,
        ))
    }

    /// The router metadata of pulled block `key` of namespace `ns`, built from what its
    /// source announced it with and charged to the namespace's tenant; `None` without
    /// events, or when it does not fit the namespace or the budget (the block is then
    /// stored unannounced, as a client's block whose metadata does not fit).
    pub fn peer_meta(&self, ns: u32, key: &Key, meta: &PeerMeta) -> Option<Arc<RouterMeta>> {
        if !self.announces() {
            return None;
        }
        let budget = self.meta_budget(ns)?;
        RouterMeta::from_peer(&budget.spec, key.0.router_hash(), meta, |b| {
            budget.charge(b)
        })
    }

    /// Registers (idempotently) a namespace.
    pub fn register(&self, spec: &NamespaceSpec) -> Result<Registered, TierError> {
        self.dram.register(spec)
    }

    /// The id of a namespace handle.
    pub fn namespace_id(&self, ns: u32) -> Result<NamespaceId, TierError> {
        self.dram.namespace_id(ns)
    }

    /// The handle of a registered namespace id (peers name namespaces by id).
    pub fn handle_of(&self, id: NamespaceId) -> Option<u32> {
        self.dram.handle_of(id)
    }

    /// The spec a namespace was registered with.
    pub fn namespace_spec(&self, ns: u32) -> Result<NamespaceSpec, TierError> {
        self.dram.namespace_spec(ns)
    }

    /// Where each key lives, without leasing or promoting anything.
    pub fn locate(&self, ns: u32, keys: &[Key]) -> Result<Vec<Location>, TierError> {
        let in_dram = self.dram.contains(ns, keys)?;
        let id = self.dram.namespace_id(ns)?;
        Ok(keys
            .iter()
            .zip(in_dram)
            .map(|(k, d)| match (d, self.nvme()) {
                (true, _) => Location::Dram,
                (false, Some(n)) if n.contains(id, k) => Location::Nvme,
                _ => Location::Absent,
            })
            .collect())
    }

    /// Length of the leading run of keys held on this node.
    pub fn exists(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        if self.nvme().is_none() {
            return self.dram.exists(ns, keys);
        }
        let at = self.locate(ns, keys)?;
        Ok(at.iter().take_while(|l| l.is_local()).count() as u32)
    }

    /// Reserves a DRAM slot per key for `owner` (a connection id, or a pull's owner id).
    pub fn reserve(
        self: &Arc<Self>,
        owner: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
    ) -> Result<Vec<Result<Reservation, PutStatus>>, TierError> {
        Ok(self
            .reserve_raw(owner, ns, keys, lens)?
            .into_iter()
            .map(|r| r.map(|r| Reservation::new(Arc::clone(self), owner, r)))
            .collect())
    }

    /// Commits reservations in order (parents given first are announced first).
    pub fn commit(&self, res: Vec<Reservation>) -> Vec<CommitStatus> {
        res.into_iter().map(Reservation::commit).collect()
    }

    /// Splits a put of blocks `lens` into runs that DRAM can take one after another while the
    /// NVMe tier drains it: a put larger than free DRAM then goes at disk speed instead of
    /// failing. Each run is at most an eighth of the DRAM tier (and at least one block).
    /// Without an NVMe tier the whole put is one run.
    pub fn put_runs(&self, lens: &[u64]) -> Vec<std::ops::Range<usize>> {
        if self.nvme().is_none() || lens.is_empty() {
            return std::iter::once(0..lens.len()).collect();
        }
        runs(lens.iter().copied(), self.window_bytes())
    }

    /// Refreshes the leading run of `keys` held in DRAM in its eviction policy (blocks an
    /// engine holds on its GPU: their hits never reach the daemon, and without this the
    /// policy would age a hot prefix's leading blocks first); returns the run's length.
    /// Blocks only on NVMe are not promoted.
    pub fn touch(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.dram.touch(ns, keys)
    }

    /// Removes keys from every tier; returns how many were held in any.
    pub fn delete(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        if self.nvme.phase() == SpillPhase::Off {
            return self.dram.delete(ns, keys);
        }
        let id = self.dram.namespace_id(ns)?;
        let remembered =
            self.nvme
                .delete_or_remember(id, keys)
                .map_err(|b| TierError::RecoveryBacklog {
                    remembered: b.remembered,
                    max: lower::REMEMBERED_KEYS_MAX,
                })?;
        let Some(nvme) = remembered else {
            return self.dram.delete(ns, keys);
        };
        let in_dram = self.dram.contains(ns, keys)?;
        self.dram.delete(ns, keys)?;
        Ok(keys
            .iter()
            .zip(in_dram)
            .map(|(k, d)| u32::from(nvme.delete(id, k) || d))
            .sum())
    }

    /// Clears one namespace, or everything (announced as `AllBlocksCleared` before any
    /// tier drops a block), in every tier; returns the larger of the tiers' counts.
    pub fn clear(&self, ns: Option<u32>) -> Result<u64, TierError> {
        let id = ns.map(|h| self.dram.namespace_id(h)).transpose()?;
        if id.is_none() {
            self.announcer.clear_all();
        }
        let n = self.dram.clear(ns)?;
        let below = self.nvme.clear_or_remember(id).map_or(0, |t| t.clear(id));
        Ok(n.max(below))
    }

    /// Counters of the DRAM tier, and the NVMe tier's row when there is one.
    pub fn snapshot(&self) -> (TierSnapshot, Option<TierStats>) {
        (self.dram.snapshot(), self.nvme().map(|t| t.stats()))
    }
}

#[cfg(test)]
mod get_tests;
#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod tests;
