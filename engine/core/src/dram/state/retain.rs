//! Retention (`kv.retain`): blocks that eviction, quota eviction, slab reclaim and demotion
//! skip until their time runs out, an unpin (`kv.release`, `kv.evict`) or their removal.
//!
//! Owned here, under the tier lock: which slots are held and until when, and the bytes they
//! hold per namespace (`NamespaceStats::retained_bytes`), which a tenant's retained quota
//! bounds. [`Retention::holds`] is the one rule every victim picker asks. Time runs out
//! lazily: every picker first ends the holds whose time has come ([`State::expire_retention`]),
//! as does a stats snapshot, so nothing needs a timer. A block that leaves DRAM for any
//! reason ends its hold in [`State::account_removed`](super::State::account_removed).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant, SystemTime};

use kvnode_proto::Key;

use super::super::TierError;
use super::super::pool::Slot;
use super::State;
use crate::policy::SlotId;

/// One held slot.
#[derive(Debug, Clone, Copy)]
struct Held {
    until: Instant,
    ns: u32,
    len: u64,
}

/// The held slots and their expiry order.
#[derive(Debug, Default)]
pub struct Retention {
    held: HashMap<SlotId, Held>,
    expiry: BTreeSet<(Instant, SlotId)>,
}

impl Retention {
    /// Whether `slot` is held: no victim picker may take it.
    pub fn holds(&self, slot: SlotId) -> bool {
        !self.held.is_empty() && self.held.contains_key(&slot)
    }

    /// Every held slot with its end as a wall-clock time (for the takeover image).
    pub fn ends(&self) -> Vec<(SlotId, SystemTime)> {
        let (now, wall) = (Instant::now(), SystemTime::now());
        self.held
            .iter()
            .map(|(&s, h)| (s, wall + h.until.saturating_duration_since(now)))
            .collect()
    }
}

/// Whose retained bytes a `kv.retain` is bounded by.
#[derive(Debug, Clone, Copy)]
pub struct RetainScope<'a> {
    /// The tenant's namespace handles (`None`: every namespace, no tenant map).
    pub set: Option<&'a [u32]>,
    /// Bytes they may hold retained.
    pub limit: u64,
    /// Bytes every tenant together may hold retained (so retention never takes the whole
    /// tier from those who hold none).
    pub tier_limit: u64,
}

/// What a `kv.retain` did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RetainOutcome {
    /// Keys now held (newly, or with their time extended).
    pub held: u32,
    /// Keys not resident in DRAM (or on their way out of it).
    pub absent: u32,
    /// Keys refused: the tenant's retained quota (or the tier's) is full.
    pub over_quota: u32,
}

impl State {
    fn retained_bytes(&self, set: Option<&[u32]>) -> u64 {
        match set {
            None => self.totals.retained_bytes,
            Some(set) => set
                .iter()
                .filter_map(|&h| self.namespaces.get(h as usize))
                .map(|e| e.stats.retained_bytes)
                .sum(),
        }
    }

    /// The DRAM slot holding key `k` of handle `ns` as a plain resident block (not doomed,
    /// not being demoted), with its length.
    fn resident_slot(&self, ns: u32, k: &Key) -> Result<Option<(SlotId, u64)>, TierError> {
        self.ns(ns)?;
        let Some(slot) = self.find(ns, &k.0, k.1) else {
            return Ok(None);
        };
        Ok(match self.slot(slot) {
            Slot::Block(r) if !r.doomed && !r.demoting() => Some((slot, r.len)),
            _ => None,
        })
    }

    fn hold(&mut self, slot: SlotId, h: Held) {
        if let Some(old) = self.retention.held.insert(slot, h) {
            self.retention.expiry.remove(&(old.until, slot));
        } else {
            self.count_retained(h.ns, h.len, true);
        }
        self.retention.expiry.insert((h.until, slot));
    }

    fn count_retained(&mut self, ns: u32, len: u64, on: bool) {
        let st = &mut self.namespaces[ns as usize].stats;
        if on {
            st.retained_blocks += 1;
            st.retained_bytes += len;
            self.totals.retained_blocks += 1;
            self.totals.retained_bytes += len;
        } else {
            st.retained_blocks -= 1;
            st.retained_bytes -= len;
            self.totals.retained_blocks -= 1;
            self.totals.retained_bytes -= len;
        }
    }

    /// Ends the hold on `slot`, if any; true if there was one.
    pub(in crate::dram) fn unretain(&mut self, slot: SlotId) -> bool {
        let Some(h) = self.retention.held.remove(&slot) else {
            return false;
        };
        self.retention.expiry.remove(&(h.until, slot));
        self.count_retained(h.ns, h.len, false);
        true
    }

    /// Ends every hold whose time has come.
    pub fn expire_retention(&mut self, now: Instant) {
        while let Some(&(until, slot)) = self.retention.expiry.first()
            && until <= now
        {
            self.unretain(slot);
            self.totals.retain_expired += 1;
        }
    }

    /// Holds the resident blocks of `keys` for `ttl` (a held block's time is extended, never
    /// shortened), within `scope`'s retained quota, keys in order.
    pub fn retain(
        &mut self,
        ns: u32,
        keys: &[Key],
        ttl: Duration,
        scope: RetainScope<'_>,
    ) -> Result<RetainOutcome, TierError> {
        let now = Instant::now();
        self.expire_retention(now);
        let until = now + ttl;
        let mut used = self.retained_bytes(scope.set);
        let mut all = self.totals.retained_bytes;
        let mut out = RetainOutcome::default();
        for k in keys {
            let Some((slot, len)) = self.resident_slot(ns, k)? else {
                out.absent += 1;
                continue;
            };
            if let Some(h) = self.retention.held.get(&slot).copied() {
                self.hold(
                    slot,
                    Held {
                        until: h.until.max(until),
                        ..h
                    },
                );
                out.held += 1;
                continue;
            }
            if used.saturating_add(len) > scope.limit || all.saturating_add(len) > scope.tier_limit
            {
                out.over_quota += 1;
                continue;
            }
            used += len;
            all += len;
            self.hold(slot, Held { until, ns, len });
            out.held += 1;
        }
        self.totals.retain_refused += u64::from(out.over_quota);
        Ok(out)
    }

    /// Ends the holds on `keys`; returns how many were held.
    pub fn release_retention(&mut self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        let mut n = 0;
        for k in keys {
            if let Some((slot, _)) = self.resident_slot(ns, k)?
                && self.unretain(slot)
            {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Holds a restored block until wall-clock time `end` (a takeover's image); a hold whose
    /// time has passed is not restored.
    pub(in crate::dram) fn restore_hold(&mut self, slot: SlotId, end: SystemTime) {
        let Ok(left) = end.duration_since(SystemTime::now()) else {
            return;
        };
        let (slab, idx) = super::super::pool::slot_parts(slot);
        let Some(Slot::Block(r)) = self
            .slabs
            .get(slab as usize)
            .and_then(|s| s.slots.get(idx as usize))
        else {
            return;
        };
        let (ns, len) = (r.ns, r.len);
        self.hold(
            slot,
            Held {
                until: Instant::now() + left,
                ns,
                len,
            },
        );
    }
}
