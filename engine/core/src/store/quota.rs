//! Reservations held to the tenant's DRAM quota (the tier does the eviction, under its lock;
//! see `dram/state/quota.rs`), and the tenant counters they feed.

use std::sync::atomic::Ordering::Relaxed;

use kvnode_proto::Key;
use kvnode_proto::client::PutStatus;

use super::Store;
use crate::dram::{QuotaScope, Reserved, TierError};

impl Store {
    /// Raw reservations: within the quota of the namespace's tenant when it has one.
    pub(super) fn reserve_raw(
        &self,
        owner: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
    ) -> Result<Vec<Result<Reserved, PutStatus>>, TierError> {
        let Some((t, set, limit)) = self.tenants.dram_scope(ns) else {
            return self.dram.reserve(owner, ns, keys, lens);
        };
        let tenant = self.tenants.get(t);
        let scope = QuotaScope {
            set: &set,
            limit,
            reserved: &tenant.dram_reserved,
        };
        let (out, q) = self.dram.reserve_within(owner, ns, keys, lens, &scope)?;
        if q.evicted > 0 {
            tenant.dram_quota_evictions.fetch_add(q.evicted, Relaxed);
        }
        if q.refused > 0 {
            tenant.quota_refusals.fetch_add(q.refused, Relaxed);
            tracing::debug!(tenant = %tenant.name, keys = q.refused, "DRAM quota reached; keys refused NoSpace");
        }
        Ok(out)
    }

    /// A reservation of `len` bytes in handle `ns` ended (committed or aborted): its bytes no
    /// longer count as reserved against the tenant's quota.
    pub(super) fn quota_release(&self, ns: u32, len: u64) {
        if let Some(t) = self.tenants.dram_quota_tenant(ns) {
            t.dram_reserved.fetch_sub(len, Relaxed);
        }
    }

    /// Bytes of resident DRAM blocks of each handle.
    pub fn namespace_bytes(&self, handles: &[u32]) -> u64 {
        self.dram.namespace_bytes(handles)
    }
}
