//! What a router's actions do to the node's tiers (api/act.rs parses and routes them):
//! retention within a tenant's retained quota, promotion ahead of a request, removal.
//! Demotion by name lives with the other moves down (demote.rs).

use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::Key;

use super::{Location, Store};
use crate::dram::{RetainOutcome, RetainScope, TierError};

/// Retention may hold 1/this of a tenant's DRAM quota when no `retain_quota` is set (of the
/// tier without a tenant map), and 1/this of the tier for all tenants together.
const DEFAULT_RETAIN_SHARE: u64 = 2;

impl Store {
    /// The namespaces whose retained bytes share handle `ns`'s quota, and that quota.
    fn retain_scope(&self, ns: u32) -> (Option<Vec<u32>>, u64) {
        let cap = self.dram.free_and_capacity().1;
        match self.tenants.of_handle(ns) {
            Some(t) if self.tenants.enabled() => {
                let tenant = self.tenants.get(t);
                let limit = tenant
                    .retain_quota
                    .unwrap_or(tenant.dram_quota.unwrap_or(cap) / DEFAULT_RETAIN_SHARE);
                (Some(self.tenants.handles(t)), limit)
            }
            _ => (None, cap / DEFAULT_RETAIN_SHARE),
        }
    }

    /// `kv.retain`: holds the resident DRAM blocks of `keys` for `ttl` within the tenant's
    /// retained quota.
    pub fn retain(&self, ns: u32, keys: &[Key], ttl: Duration) -> Result<RetainOutcome, TierError> {
        let (set, limit) = self.retain_scope(ns);
        let scope = RetainScope {
            set: set.as_deref(),
            limit,
            tier_limit: self.dram.free_and_capacity().1 / DEFAULT_RETAIN_SHARE,
        };
        self.dram.retain(ns, keys, ttl, scope)
    }

    /// `kv.release`: ends the holds on `keys`; returns how many were held.
    pub fn release_retention(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.dram.release_retention(ns, keys)
    }

    /// `kv.evict`: ends the holds on `keys` and removes them from every tier; returns how
    /// many were held anywhere.
    pub fn evict(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.dram.release_retention(ns, keys)?;
        self.delete(ns, keys)
    }

    /// `kv.prefetch` from this node's NVMe: the keys held only there, to be promoted into
    /// DRAM by the returned task (it runs to the end even if nobody awaits it). `None` when
    /// nothing is to be promoted.
    pub fn promote_in_background(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
    ) -> Result<(u32, Option<tokio::task::JoinHandle<u32>>), TierError> {
        let Some(nvme) = self.nvme() else {
            return Ok((0, None));
        };
        let id = self.dram.namespace_id(ns)?;
        let want: Vec<(usize, Key, u64)> = self
            .locate(ns, keys)?
            .into_iter()
            .zip(keys)
            .enumerate()
            .filter(|(_, (l, _))| *l == Location::Nvme)
            .filter_map(|(i, (_, k))| nvme.block_len(id, k).map(|len| (i, *k, len)))
            .collect();
        if want.is_empty() {
            return Ok((0, None));
        }
        let n = want.len() as u32;
        let store = Arc::clone(self);
        let task = tokio::spawn(async move {
            // Each promoted block lands leased; the lease ends here and the block stays.
            let got = store.promote(ns, want).await;
            got.iter()
                .filter(|(_, g)| matches!(g, super::Got::Leased(_)))
                .count() as u32
        });
        Ok((n, Some(task)))
    }
}
