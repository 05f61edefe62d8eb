//! Per-tenant DRAM quotas, enforced where slots are reserved, under the tier lock.
//!
//! A tenant is a set of namespace handles with a byte limit on their resident blocks. A
//! reservation that would take the set over its limit first evicts the set's own
//! least-recently-used unleased blocks (class by class, the key's own class first); only if
//! nothing of the tenant's can go is the key refused `NoSpace`. So a tenant at its quota
//! keeps caching (its oldest blocks make way) and never evicts another tenant's blocks to
//! grow past it. Counted: bytes of committed blocks plus the bytes the tenant holds reserved
//! (`reserved`, raised here under the tier lock, lowered by the store's guard when the
//! reservation commits or aborts), so slow writers on many connections cannot pass it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvnode_proto::Key;
use kvnode_proto::client::PutStatus;

use super::super::pool::{Slot, slot_parts};
use super::super::{DramTier, Reserved, TierError};
use super::State;
use crate::policy::EvictionPolicy as _;

/// One tenant's DRAM quota as a reservation sees it.
#[derive(Debug, Clone, Copy)]
pub struct QuotaScope<'a> {
    /// The tenant's namespace handles.
    pub set: &'a [u32],
    /// Bytes its blocks and reservations may take.
    pub limit: u64,
    /// Bytes it holds reserved: raised under the tier lock as slots are reserved, lowered
    /// by whoever ends a reservation (the store's guard).
    pub reserved: &'a AtomicU64,
}

/// What a quota-bounded reservation did besides reserving.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct QuotaOutcome {
    /// Own blocks evicted to make room within the quota.
    pub evicted: u64,
    /// Keys refused because the quota was reached with nothing evictable.
    pub refused: u64,
}

impl State {
    fn set_bytes(&self, set: &[u32]) -> u64 {
        set.iter()
            .filter_map(|&h| self.namespaces.get(h as usize))
            .map(|e| e.stats.bytes)
            .sum()
    }

    /// Evicts one unleased block of a namespace in `set` (class `first` tried first) and
    /// puts its slot on its class's free list; returns its length. Cost: the policy walks
    /// its order from the cold end skipping other tenants' blocks, so it grows with the
    /// number of other tenants' blocks colder than this tenant's coldest (one pass per
    /// eviction, under the tier lock); a per-tenant eviction order would make it O(1).
    fn evict_own(&mut self, set: &[u32], first: u32) -> Option<u64> {
        let mut classes: Vec<u32> = vec![first];
        for &h in set {
            if let Some(e) = self.namespaces.get(h as usize) {
                classes.extend(e.classes.iter().copied());
            }
        }
        classes.dedup();
        self.expire_retention(std::time::Instant::now());
        for c in classes {
            let (slabs, held) = (&self.slabs, &self.retention);
            let victim = self.pools[c as usize].policy.victim(&mut |s| {
                let (slab, idx) = slot_parts(s);
                matches!(&slabs[slab as usize].slots[idx as usize],
                    Slot::Block(r) if r.leases == 0 && set.contains(&r.ns))
                    && !held.holds(s)
            });
            let Some(v) = victim else { continue };
            let Slot::Block(r) = self.slot(v) else {
                unreachable!("victims are blocks")
            };
            let len = r.len;
            self.pools[c as usize].evictions += 1;
            self.count_drop(v);
            self.drop_block(v, true);
            self.pools[c as usize].free.push(v);
            return Some(len);
        }
        None
    }

    /// Like `reserve`, keeping the blocks of the scope's namespaces plus its reserved bytes
    /// within its limit; adds what it reserves to the scope's reserved bytes.
    pub fn reserve_within(
        &mut self,
        conn: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
        q: &QuotaScope<'_>,
    ) -> Result<(Vec<Result<Reserved, PutStatus>>, QuotaOutcome), TierError> {
        let QuotaScope {
            set,
            limit,
            reserved,
        } = *q;
        let e = self.ns(ns)?;
        let classes = e.classes.clone();
        let segments = e.spec.segments.clone();
        let mut used = self.set_bytes(set).saturating_add(reserved.load(Relaxed));
        let mut done = QuotaOutcome::default();
        let mut out = Vec::with_capacity(keys.len());
        for (i, (k, &len)) in keys.iter().zip(lens).enumerate() {
            let hint = crate::policy::BatchHint::at(i, keys.len());
            // Refusals that need no room come first: never evict for a key that fails anyway.
            let seg = usize::from(k.1);
            let Some(class) = classes.get(seg).copied() else {
                out.push(self.reserve_one(conn, ns, k, len, hint)?);
                continue;
            };
            if self.find(ns, &k.0, k.1).is_some() || len > segments[seg] {
                out.push(self.reserve_one(conn, ns, k, len, hint)?);
                continue;
            }
            if len > limit {
                done.refused += 1;
                out.push(Err(PutStatus::NoSpace));
                continue;
            }
            while used.saturating_add(len) > limit {
                let Some(freed) = self.evict_own(set, class) else {
                    break;
                };
                used = used.saturating_sub(freed);
                done.evicted += 1;
            }
            if used.saturating_add(len) > limit {
                done.refused += 1;
                out.push(Err(PutStatus::NoSpace));
                continue;
            }
            let r = self.reserve_one(conn, ns, k, len, hint)?;
            if r.is_ok() {
                used += len;
                reserved.fetch_add(len, Relaxed);
            }
            out.push(r);
        }
        Ok((out, done))
    }
}

impl DramTier {
    /// Reserves like [`DramTier::reserve`], keeping one tenant's resident blocks and held
    /// reservations within its quota (`q`): own blocks are evicted first, and a key that
    /// still does not fit is refused `NoSpace`.
    pub(crate) fn reserve_within(
        &self,
        conn: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
        q: &QuotaScope<'_>,
    ) -> Result<(Vec<Result<Reserved, PutStatus>>, QuotaOutcome), TierError> {
        if keys.len() != lens.len() {
            return Err(TierError::LengthMismatch {
                keys: keys.len(),
                lens: lens.len(),
            });
        }
        self.with(|s| s.reserve_within(conn, ns, keys, lens, q))
    }

    /// Bytes of resident blocks of each handle in `handles` (0 for an unknown one).
    pub fn namespace_bytes(&self, handles: &[u32]) -> u64 {
        self.with(|s| s.set_bytes(handles))
    }
}
