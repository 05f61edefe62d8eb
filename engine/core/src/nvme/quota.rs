//! Per-tenant NVMe usage and quotas: a ledger of the blocks this daemon wrote to NVMe since
//! it started, by tenant, in write order.
//!
//! A demotion of a block whose tenant would go over its `nvme_quota` first deletes that
//! tenant's oldest NVMe blocks (never another tenant's); a block larger than the whole quota
//! is not written (it leaves DRAM as it would without an NVMe tier). Blocks recovered from the
//! spill files at start-up are not in the ledger: they are served as before and charged to
//! nobody until they are deleted or evicted (docs/operations.md says so).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kvnode_proto::NamespaceId;
use kvnode_spill::SpillKey;

use super::NvmeTier;
use crate::tenant::{TenantId, Tenants};

#[derive(Debug, Default)]
struct Ledger {
    blocks: HashMap<SpillKey, (TenantId, u64)>,
    /// Keys per tenant in write order (may hold keys no longer charged: skipped).
    order: HashMap<TenantId, VecDeque<SpillKey>>,
}

/// The ledger and the tenant map it charges.
#[derive(Debug, Default)]
pub(super) struct NvmeQuota {
    tenants: OnceLock<Arc<Tenants>>,
    ledger: Mutex<Ledger>,
}

impl NvmeQuota {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets a block the spill tier no longer holds.
    pub fn uncharge(&self, k: &SpillKey) {
        let Some(tenants) = self.tenants.get() else {
            return;
        };
        if let Some((t, len)) = self.ledger().blocks.remove(k) {
            tenants.get(t).nvme_bytes.fetch_sub(len, Relaxed);
        }
    }
}

impl NvmeTier {
    /// Charges blocks written from now on to the tenants of `tenants` (once, at start).
    pub fn set_tenants(&self, tenants: Arc<Tenants>) {
        if tenants.enabled() {
            let _ = self.quota.tenants.set(tenants);
        }
    }

    /// Before writing a block of namespace `ns` of `len` bytes: deletes the tenant's oldest
    /// NVMe blocks until the block fits its quota. False: the block cannot fit at all.
    pub(super) fn quota_room(&self, ns: NamespaceId, len: u64) -> bool {
        let Some(tenants) = self.quota.tenants.get() else {
            return true;
        };
        let Some(t) = tenants.of_id(ns) else {
            return true;
        };
        let tenant = tenants.get(t);
        let Some(limit) = tenant.nvme_quota else {
            return true;
        };
        if len > limit {
            return false;
        }
        loop {
            if tenant.nvme_bytes.load(Relaxed).saturating_add(len) <= limit {
                return true;
            }
            let victim = {
                let mut l = self.quota.ledger();
                let Ledger { blocks, order } = &mut *l;
                let q = order.entry(t).or_default();
                let mut found = None;
                while let Some(k) = q.pop_front() {
                    if blocks.contains_key(&k) {
                        found = Some(k);
                        break;
                    }
                }
                found
            };
            // Nothing of the tenant's left to drop (its bytes are in flight elsewhere).
            let Some(k) = victim else { return false };
            if self.spill.delete(&k) {
                tenant.nvme_quota_evictions.fetch_add(1, Relaxed);
            }
            self.forget(&[k]);
        }
    }

    /// Charges a block just written to NVMe to its namespace's tenant.
    pub(super) fn quota_charge(&self, k: SpillKey, ns: NamespaceId, len: u64) {
        let Some(tenants) = self.quota.tenants.get() else {
            return;
        };
        let Some(t) = tenants.of_id(ns) else {
            return;
        };
        let mut l = self.quota.ledger();
        if l.blocks.insert(k, (t, len)).is_none() {
            tenants.get(t).nvme_bytes.fetch_add(len, Relaxed);
            l.order.entry(t).or_default().push_back(k);
        }
    }
}
