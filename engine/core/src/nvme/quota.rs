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

/// What [`NvmeTier::quota_room`] decided for one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaRoom {
    /// No quota applies.
    Free,
    /// The block's bytes are held in its tenant's quota until the write settles.
    Held(TenantId),
    /// The block does not fit its tenant's quota: do not write it.
    NoRoom,
}

#[derive(Debug, Default)]
struct Ledger {
    blocks: HashMap<SpillKey, (TenantId, u64)>,
    /// Keys per tenant with an NVMe quota, in write order (may hold keys no longer charged:
    /// skipped when popped).
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

    /// Before writing a block of namespace `ns` of `len` bytes: when its tenant has an NVMe
    /// quota, holds `len` bytes of it (deleting the tenant's oldest NVMe blocks until they
    /// fit), so concurrent demotions cannot pass the quota together.
    pub(crate) fn quota_room(&self, ns: NamespaceId, len: u64) -> QuotaRoom {
        let Some(tenants) = self.quota.tenants.get() else {
            return QuotaRoom::Free;
        };
        let Some(t) = tenants.of_id(ns) else {
            return QuotaRoom::Free;
        };
        let tenant = tenants.get(t);
        let Some(limit) = tenant.nvme_quota else {
            return QuotaRoom::Free;
        };
        if len > limit {
            return QuotaRoom::NoRoom;
        }
        loop {
            let held = tenant.nvme_bytes.fetch_update(Relaxed, Relaxed, |b| {
                (b.saturating_add(len) <= limit).then_some(b + len)
            });
            if held.is_ok() {
                return QuotaRoom::Held(t);
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
            // Nothing of the tenant's left to drop (its bytes are writes in flight).
            let Some(k) = victim else {
                return QuotaRoom::NoRoom;
            };
            if self.spill.delete(&k) {
                tenant.nvme_quota_evictions.fetch_add(1, Relaxed);
            }
            self.forget(&[k]);
        }
    }

    /// [`NvmeTier::quota_room`] into `room`; true when the block must not be written.
    pub fn no_quota_room(&self, room: &mut QuotaRoom, ns: NamespaceId, len: u64) -> bool {
        *room = self.quota_room(ns, len);
        *room == QuotaRoom::NoRoom
    }

    /// After a demotion: charges a block that is now on NVMe to its tenant (bytes held by
    /// [`NvmeTier::quota_room`] become the block's), or gives held bytes back.
    pub fn quota_settle(
        &self,
        room: QuotaRoom,
        k: SpillKey,
        ns: NamespaceId,
        len: u64,
        on_nvme: bool,
    ) {
        let Some(tenants) = self.quota.tenants.get() else {
            return;
        };
        let t = match room {
            QuotaRoom::Held(t) => Some(t),
            QuotaRoom::Free => tenants.of_id(ns),
            QuotaRoom::NoRoom => None,
        };
        let Some(t) = t else { return };
        let tenant = tenants.get(t);
        let held = matches!(room, QuotaRoom::Held(_));
        let charged_now = on_nvme && {
            let mut l = self.quota.ledger();
            let new = l.blocks.insert(k, (t, len)).is_none();
            // The write order is kept only where a quota needs an oldest block to drop.
            if new && tenant.nvme_quota.is_some() {
                l.order.entry(t).or_default().push_back(k);
            }
            new
        };
        let bytes = &tenant.nvme_bytes;
        match (held, charged_now) {
            (true, false) => drop(bytes.fetch_sub(len, Relaxed)),
            (false, true) => drop(bytes.fetch_add(len, Relaxed)),
            _ => {}
        }
    }
}
