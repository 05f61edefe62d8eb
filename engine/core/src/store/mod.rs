//! The node store: the one owner of the lookup order DRAM → NVMe, and of every slot guard.
//!
//! ```text
//!  client api ─┐                       ┌─> DramTier (index, slot classes, leases, eviction)
//!  peer source ├─> Store ── lookup ────┤        ^ promote (reserve, read, commit, lease)
//!  peer fetch  │   lease / exists /    └─> NvmeTier (spill files; demoter moves blocks down)
//!  gpu ops    ─┘   reserve / delete / clear
//! ```
//!
//! Every path that looks a block up goes through [`Store::lease`] or [`Store::locate`], so a
//! block on this node's NVMe is found the same way by a plain `get`, a hinted `get`, a
//! peer's pull and a GPU onload. Slots are handed out only as guards ([`Lease`],
//! [`Reservation`]) that release themselves when dropped.

mod guard;
mod quota;

use std::sync::Arc;

use kvnode_proto::client::{CommitStatus, PutStatus};
use kvnode_proto::stats::TierStats;
use kvnode_proto::{Key, NamespaceId, NamespaceSpec};

use crate::arena::Arena;
use crate::dram::{DramTier, Registered, TierError, TierSnapshot};
use crate::nvme::NvmeTier;
use crate::residency::Announcer;
use crate::tenant::Tenants;

pub use guard::{Lease, Reservation};

/// Owner id of reservations the store makes itself (promotions from NVMe).
const STORE_OWNER: u64 = 0;

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
    nvme: Option<Arc<NvmeTier>>,
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
            nvme,
            announcer,
            tenants,
        })
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
        self.nvme.as_ref()
    }

    /// Whether stored blocks are announced to a router (KV events are on).
    pub fn announces(&self) -> bool {
        self.announcer.enabled()
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
            .map(|(k, d)| match (d, &self.nvme) {
                (true, _) => Location::Dram,
                (false, Some(n)) if n.contains(id, k) => Location::Nvme,
                _ => Location::Absent,
            })
            .collect())
    }

    /// Length of the leading run of keys held on this node.
    pub fn exists(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        if self.nvme.is_none() {
            return self.dram.exists(ns, keys);
        }
        let at = self.locate(ns, keys)?;
        Ok(at.iter().take_while(|l| l.is_local()).count() as u32)
    }

    /// Leases every key held on this node: DRAM hits at once, NVMe-only keys promoted into
    /// DRAM first. Misses are `None`.
    pub async fn lease(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
    ) -> Result<Vec<Option<Lease>>, TierError> {
        let mut out: Vec<Option<Lease>> = self
            .dram
            .lease(ns, keys)?
            .into_iter()
            .map(|l| l.map(|l| Lease::new(Arc::clone(self), l)))
            .collect();
        if self.nvme.is_some() && out.iter().any(Option::is_none) {
            let missing: Vec<(usize, Key)> = keys
                .iter()
                .enumerate()
                .filter(|(i, _)| out[*i].is_none())
                .map(|(i, k)| (i, *k))
                .collect();
            // Its own task: a dropped request cannot strand a slot under an in-flight read.
            let s = Arc::clone(self);
            if let Ok(got) = tokio::spawn(async move { s.promote(ns, missing).await }).await {
                for (i, l) in got {
                    out[i] = Some(l);
                }
            }
        }
        Ok(out)
    }

    /// Reads NVMe-only keys into fresh DRAM slots, commits them (announced as DRAM stores)
    /// and leases them.
    async fn promote(self: &Arc<Self>, ns: u32, want: Vec<(usize, Key)>) -> Vec<(usize, Lease)> {
        let Some(nvme) = &self.nvme else {
            return Vec::new();
        };
        let Ok(id) = self.dram.namespace_id(ns) else {
            return Vec::new();
        };
        let want: Vec<(usize, Key, u64)> = want
            .into_iter()
            .filter_map(|(i, k)| nvme.block_len(id, &k).map(|l| (i, k, l)))
            .collect();
        let keys: Vec<Key> = want.iter().map(|w| w.1).collect();
        let lens: Vec<u64> = want.iter().map(|w| w.2).collect();
        // Room first, like a put: demote ahead rather than evict blocks without a copy.
        nvme.make_room(lens.iter().sum()).await;
        let Ok(reserved) = self.reserve(STORE_OWNER, ns, &keys, &lens) else {
            return Vec::new();
        };
        let reads: Vec<_> = want
            .iter()
            .zip(reserved)
            .filter_map(|(w, r)| r.ok().map(|r| (w.0, w.1, r)))
            .map(|(i, k, r)| {
                let pending = nvme.submit_read(id, &k, r.offset(), r.len());
                (i, k, r, pending)
            })
            .collect();
        let mut landed = Vec::new();
        for (i, k, mut r, pending) in reads {
            // A miss drops `r`: the slot is freed unpublished.
            if let Some(meta) = nvme.finish_read(ns, pending).await {
                r.set_meta(meta);
                if r.commit_as(true, None) == CommitStatus::Committed {
                    landed.push((i, k));
                }
            }
        }
        nvme.count_promotions(landed.len() as u64);
        self.dram.count_promotions(landed.len() as u64);
        let keys: Vec<Key> = landed.iter().map(|x| x.1).collect();
        let Ok(leased) = self.dram.lease(ns, &keys) else {
            return Vec::new();
        };
        landed
            .iter()
            .zip(leased)
            .filter_map(|((i, _), l)| l.map(|l| (*i, Lease::new(Arc::clone(self), l))))
            .collect()
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
        if self.nvme.is_none() || lens.is_empty() {
            return std::iter::once(0..lens.len()).collect();
        }
        let max = (self.dram.free_and_capacity().1 / 8).max(1);
        let mut runs = Vec::new();
        let (mut start, mut bytes) = (0, 0u64);
        for (i, &l) in lens.iter().enumerate() {
            if i > start && bytes.saturating_add(l) > max {
                runs.push(start..i);
                (start, bytes) = (i, 0);
            }
            bytes = bytes.saturating_add(l);
        }
        runs.push(start..lens.len());
        runs
    }

    /// Waits (bounded) until DRAM has `bytes` free, demoting to NVMe ahead of need.
    pub async fn make_room(&self, bytes: u64) {
        if let Some(n) = &self.nvme {
            n.make_room(bytes).await;
        }
    }

    /// Removes keys from every tier; returns how many were held in any.
    pub fn delete(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        let Some(nvme) = &self.nvme else {
            return self.dram.delete(ns, keys);
        };
        let id = self.dram.namespace_id(ns)?;
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
        let below = self.nvme.as_ref().map_or(0, |t| t.clear(id));
        Ok(n.max(below))
    }

    /// Counters of the DRAM tier, and the NVMe tier's row when there is one.
    pub fn snapshot(&self) -> (TierSnapshot, Option<TierStats>) {
        (self.dram.snapshot(), self.nvme.as_ref().map(|t| t.stats()))
    }
}

#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod tests;
