//! The tier's metadata and its algorithms (allocation, eviction, slab reclaim), lock held.

use std::collections::HashMap;

use kvnode_proto::client::{CommitStatus, Extent, PutStatus, SegmentClass};
use kvnode_proto::stats::{NamespaceStats, PoolStats, TierStats};
use kvnode_proto::{BlockKey, Key, NamespaceId, NamespaceSpec};

use super::index::Index;
use super::pool::{Pool, Resident, Slab, Slot, class_bytes, slot_id, slot_parts};
use super::{Leased, Registered, Reserved, TierConfig, TierError, TierSnapshot};
use crate::policy::{BatchHint, EvictionPolicy, PolicyKind, SlotId};
use crate::residency::{Announcer, RouterMeta};
use kvnode_events::Medium;
use std::sync::Arc;

const MAX_CLASSES: usize = 4096;

pub(super) mod live;
mod lookup;
pub(super) mod quota;
pub(super) mod retain;

#[derive(Debug)]
pub(super) struct NsEntry {
    pub id: NamespaceId,
    pub spec: NamespaceSpec,
    classes: Vec<u32>,
    stats: NamespaceStats,
}

#[derive(Debug)]
pub(super) struct State {
    pub slab_bytes: u64,
    capacity: u64,
    policy: PolicyKind,
    pub slabs: Vec<Slab>,
    pub free_slabs: Vec<u32>,
    /// Assigned slabs with no used slot: another class may take them without evicting.
    empty_slabs: std::collections::BTreeSet<u32>,
    pub pools: Vec<Pool>,
    class_by_size: HashMap<u64, u32>,
    /// Slot ids by key (index.rs; the keys live in the slots).
    index: Index,
    pub namespaces: Vec<NsEntry>,
    ns_by_id: HashMap<NamespaceId, u32>,
    pub totals: TierStats,
    pub announcer: Arc<Announcer>,
    /// A lower tier exists: evicting a block without a copy below counts as `dropped`.
    pub has_lower: bool,
    /// Bytes of slots whose demotion is in flight (free once it ends).
    pub demoting_bytes: u64,
    /// Committed blocks awaiting their write-behind copy (`spill.lag`; copy.rs).
    pub write_behind: super::pool::WriteBehind,
    /// Blocks held by `kv.retain` (state/retain.rs).
    pub retention: retain::Retention,
    /// Slots changed since a live takeover image began (state/live.rs); `None` when none is
    /// under way.
    dirty: Option<std::collections::HashSet<SlotId>>,
}

impl NsEntry {
    /// The slot class of a segment.
    pub fn class_of(&self, segment: u16) -> Option<u32> {
        self.classes.get(usize::from(segment)).copied()
    }
}

pub(super) fn key_hash(k: &BlockKey) -> u64 {
    k.digest.router_hash() ^ (k.ns.0 as u64) ^ (u64::from(k.segment) << 48)
}

impl State {
    pub fn new(cfg: &TierConfig, announcer: Arc<Announcer>) -> Self {
        let n = (cfg.capacity / cfg.slab_bytes) as u32;
        Self {
            slab_bytes: cfg.slab_bytes,
            capacity: u64::from(n) * cfg.slab_bytes,
            policy: cfg.policy,
            slabs: (0..n).map(|_| Slab::default()).collect(),
            free_slabs: (0..n).rev().collect(),
            empty_slabs: std::collections::BTreeSet::new(),
            pools: Vec::new(),
            class_by_size: HashMap::new(),
            index: Index::default(),
            namespaces: Vec::new(),
            ns_by_id: HashMap::new(),
            totals: TierStats {
                tier: "dram".into(),
                ..TierStats::default()
            },
            announcer,
            has_lower: false,
            demoting_bytes: 0,
            write_behind: super::pool::WriteBehind::default(),
            retention: retain::Retention::default(),
            dirty: None,
        }
    }

    pub fn ns(&self, ns: u32) -> Result<&NsEntry, TierError> {
        self.namespaces
            .get(ns as usize)
            .ok_or(TierError::UnknownNamespace(ns))
    }

    pub(super) fn ns_stats_mut(&mut self, h: u32) -> &mut NamespaceStats {
        &mut self.namespaces[h as usize].stats
    }

    pub fn handle_of(&self, id: NamespaceId) -> Option<u32> {
        self.ns_by_id.get(&id).copied()
    }

    pub fn register(&mut self, spec: &NamespaceSpec) -> Result<Registered, TierError> {
        spec.validate()?;
        let id = spec.id();
        if let Some(&h) = self.ns_by_id.get(&id) {
            return Ok(self.registered(h));
        }
        let mut classes = Vec::with_capacity(spec.segments.len());
        for (segment, &size) in spec.segments.iter().enumerate() {
            let bytes = class_bytes(size);
            if bytes > self.slab_bytes {
                return Err(TierError::SlotTooLarge {
                    segment,
                    size,
                    slab: self.slab_bytes,
                });
            }
            let class = if let Some(&c) = self.class_by_size.get(&bytes) {
                c
            } else {
                if self.pools.len() >= MAX_CLASSES {
                    return Err(TierError::TooManyClasses(self.pools.len()));
                }
                let c = self.pools.len() as u32;
                self.pools.push(Pool::new(c, bytes, self.policy));
                self.class_by_size.insert(bytes, c);
                c
            };
            classes.push(class);
        }
        let h = self.namespaces.len() as u32;
        let stats = NamespaceStats {
            ns: h,
            id: id.to_string(),
            model: spec.model.clone(),
            ..NamespaceStats::default()
        };
        self.namespaces.push(NsEntry {
            id,
            spec: spec.clone(),
            classes,
            stats,
        });
        self.ns_by_id.insert(id, h);
        Ok(self.registered(h))
    }

    fn registered(&self, h: u32) -> Registered {
        let e = &self.namespaces[h as usize];
        let segments = e
            .classes
            .iter()
            .enumerate()
            .map(|(i, &c)| SegmentClass {
                segment: i as u16,
                slot_size: e.spec.segments[i],
                class: c,
                class_slot_bytes: self.pools[c as usize].slot_bytes,
            })
            .collect();
        Registered {
            ns: h,
            id: e.id,
            segments,
        }
    }

    fn block_key(&self, ns: u32, k: &Key) -> Result<BlockKey, TierError> {
        Ok(BlockKey {
            ns: self.ns(ns)?.id,
            digest: k.0,
            segment: k.1,
        })
    }

    pub fn offset(&self, slot: SlotId) -> u64 {
        let (slab, idx) = slot_parts(slot);
        let class = self.slabs[slab as usize]
            .class
            .expect("slot of an assigned slab");
        u64::from(slab) * self.slab_bytes + u64::from(idx) * self.pools[class as usize].slot_bytes
    }

    /// The slot, to change it: every change of a slot goes through here, so a live
    /// takeover image notes it (state/live.rs).
    pub fn slot_mut(&mut self, slot: SlotId) -> &mut Slot {
        if let Some(d) = &mut self.dirty {
            d.insert(slot);
        }
        let (slab, idx) = slot_parts(slot);
        &mut self.slabs[slab as usize].slots[idx as usize]
    }

    /// The slot, to change only what an image does not carry (leases, read counts): not
    /// noted by a live takeover image, so reads during one do not grow its delta.
    fn slot_counters_mut(&mut self, slot: SlotId) -> &mut Slot {
        let (slab, idx) = slot_parts(slot);
        &mut self.slabs[slab as usize].slots[idx as usize]
    }

    pub(in crate::dram) fn slot(&self, slot: SlotId) -> &Slot {
        let (slab, idx) = slot_parts(slot);
        &self.slabs[slab as usize].slots[idx as usize]
    }

    pub fn class_of(&self, slot: SlotId) -> u32 {
        self.slabs[slot_parts(slot).0 as usize]
            .class
            .expect("assigned")
    }

    pub fn reserve(
        &mut self,
        conn: u64,
        ns: u32,
        keys: &[Key],
        lens: &[u64],
    ) -> Result<Vec<Result<Reserved, PutStatus>>, TierError> {
        self.ns(ns)?;
        let mut out = Vec::with_capacity(keys.len());
        for (i, (k, &len)) in keys.iter().zip(lens).enumerate() {
            let hint = BatchHint::at(i, keys.len());
            out.push(self.reserve_one(conn, ns, k, len, hint)?);
        }
        Ok(out)
    }

    fn reserve_one(
        &mut self,
        conn: u64,
        ns: u32,
        k: &Key,
        len: u64,
        hint: BatchHint,
    ) -> Result<Result<Reserved, PutStatus>, TierError> {
        let key = self.block_key(ns, k)?;
        let e = &self.namespaces[ns as usize];
        let Some(&class) = e.classes.get(usize::from(k.1)) else {
            return Ok(Err(PutStatus::BadSegment));
        };
        if len > e.spec.segments[usize::from(k.1)] {
            return Ok(Err(PutStatus::TooLarge));
        }
        if self.find(ns, &k.0, k.1).is_some() {
            return Ok(Err(PutStatus::Exists));
        }
        let Some(slot) = self.alloc_slot(class) else {
            return Ok(Err(PutStatus::NoSpace));
        };
        *self.slot_mut(slot) = Slot::Reserved { conn };
        self.mark_used(slot);
        self.totals.reserved += 1;
        self.pools[class as usize].reserved += 1;
        Ok(Ok(Reserved {
            slot,
            key,
            ns,
            offset: self.offset(slot),
            len,
            hint,
        }))
    }

    /// A free slot of `class`: free list, a free slab, an eviction, or a reclaimed slab.
    fn alloc_slot(&mut self, class: u32) -> Option<SlotId> {
        let c = class as usize;
        if let Some(s) = self.pop_free(c) {
            return Some(s);
        }
        if let Some(slab) = self.free_slabs.pop() {
            self.assign_slab(slab, class);
            return self.pools[c].free.pop();
        }
        if let Some(slab) = self.take_empty_slab(class) {
            self.assign_slab(slab, class);
            return self.pools[c].free.pop();
        }
        if let Some(s) = self.evict_one(class) {
            return Some(s);
        }
        let slab = self.reclaim_slab(class)?;
        self.assign_slab(slab, class);
        self.pools[c].free.pop()
    }

    pub(super) fn assign_slab(&mut self, slab: u32, class: u32) {
        let per = (self.slab_bytes / self.pools[class as usize].slot_bytes) as u32;
        let s = &mut self.slabs[slab as usize];
        s.class = Some(class);
        s.slots = (0..per).map(|_| Slot::Free).collect();
        s.used = 0;
        self.empty_slabs.insert(slab);
        let pool = &mut self.pools[class as usize];
        pool.slabs.push(slab);
        pool.free.extend((0..per).rev().map(|i| slot_id(slab, i)));
    }

    /// A slot left `Free`: count it, and note when its slab became empty.
    pub(super) fn mark_used(&mut self, slot: SlotId) {
        let slab = slot_parts(slot).0;
        let s = &mut self.slabs[slab as usize];
        s.used += 1;
        if s.used == 1 {
            self.empty_slabs.remove(&slab);
        }
    }

    /// A slot became `Free`.
    fn mark_free(&mut self, slot: SlotId) {
        let slab = slot_parts(slot).0;
        let s = &mut self.slabs[slab as usize];
        s.used -= 1;
        if s.used == 0 {
            self.empty_slabs.insert(slab);
        }
    }

    /// Detaches an empty slab of another class (no eviction needed), e.g. after a clear.
    fn take_empty_slab(&mut self, for_class: u32) -> Option<u32> {
        let slab = self
            .empty_slabs
            .iter()
            .copied()
            .find(|&s| self.slabs[s as usize].class != Some(for_class))?;
        let owner = self.slabs[slab as usize]
            .class
            .expect("empty slabs are assigned");
        let pool = &mut self.pools[owner as usize];
        pool.free.retain(|&s| slot_parts(s).0 != slab);
        pool.slabs.retain(|&s| s != slab);
        self.slabs[slab as usize] = Slab::default();
        self.empty_slabs.remove(&slab);
        Some(slab)
    }

    fn evict_one(&mut self, class: u32) -> Option<SlotId> {
        let c = class as usize;
        self.expire_retention(std::time::Instant::now());
        let (slabs, held) = (&self.slabs, &self.retention);
        let victim = self.pools[c].policy.victim(&mut |s| {
            let (slab, idx) = slot_parts(s);
            matches!(&slabs[slab as usize].slots[idx as usize], Slot::Block(r) if r.leases == 0)
                && !held.holds(s)
        })?;
        self.pools[c].evictions += 1;
        self.count_drop(victim);
        self.drop_block(victim, true);
        Some(victim)
    }

    /// Takes a whole slab from another class: one with no reserved or leased slot.
    fn reclaim_slab(&mut self, for_class: u32) -> Option<u32> {
        self.expire_retention(std::time::Instant::now());
        let mut donors: Vec<u32> = (0..self.pools.len() as u32)
            .filter(|&c| c != for_class && !self.pools[c as usize].slabs.is_empty())
            .collect();
        donors.sort_by_key(|&c| std::cmp::Reverse(self.pools[c as usize].slabs.len()));
        for c in donors {
            let found = self.pools[c as usize].slabs.iter().copied().find(|&slab| {
                let slots = &self.slabs[slab as usize].slots;
                slots.iter().enumerate().all(|(i, s)| match s {
                    Slot::Free => true,
                    Slot::Reserved { .. } => false,
                    Slot::Block(r) => {
                        r.leases == 0 && !self.retention.holds(slot_id(slab, i as u32))
                    }
                })
            });
            let Some(slab) = found else { continue };
            let n = self.slabs[slab as usize].slots.len() as u32;
            for i in 0..n {
                let id = slot_id(slab, i);
                if matches!(self.slot(id), Slot::Block(_)) {
                    self.pools[c as usize].policy.remove(id);
                    self.pools[c as usize].evictions += 1;
                    self.count_drop(id);
                    self.drop_block(id, true);
                }
            }
            let pool = &mut self.pools[c as usize];
            pool.free.retain(|&s| slot_parts(s).0 != slab);
            pool.slabs.retain(|&s| s != slab);
            self.slabs[slab as usize] = Slab::default();
            self.empty_slabs.remove(&slab);
            return Some(slab);
        }
        None
    }

    /// Removes the block in `slot` from the index and counters and marks the slot free
    /// (the caller owns the free slot; it is not put on a free list). Policy already updated.
    pub fn drop_block(&mut self, slot: SlotId, evicted: bool) {
        let Slot::Block(r) = std::mem::replace(self.slot_mut(slot), Slot::Free) else {
            unreachable!("drop_block on a non-block slot");
        };
        self.mark_free(slot);
        debug_assert_eq!(r.leases, 0);
        if !r.doomed {
            self.index_remove(slot, &r);
            self.account_removed(slot, r.ns, r.len, evicted);
        }
        // `r.residency` drops here: the block left DRAM.
    }

    /// Counts an eviction that leaves no copy in the lower tier.
    fn count_drop(&mut self, slot: SlotId) {
        if self.has_lower
            && let Slot::Block(r) = self.slot(slot)
            && !r.on_lower()
        {
            self.totals.dropped += 1;
        }
    }

    /// The block in `slot` left the index: counters, and its retention ends.
    pub fn account_removed(&mut self, slot: SlotId, ns: u32, len: u64, evicted: bool) {
        self.unretain(slot);
        self.totals.blocks -= 1;
        self.totals.bytes -= len;
        let st = &mut self.namespaces[ns as usize].stats;
        st.blocks -= 1;
        st.bytes -= len;
        if evicted {
            crate::probes::evict(kvnode_proto::obs::TierCode::Dram, ns, len);
            st.evictions += 1;
            self.totals.evictions += 1;
        } else {
            st.removed += 1;
        }
    }

    pub fn free_slot(&mut self, slot: SlotId) {
        debug_assert!(
            !matches!(self.slot(slot), Slot::Free),
            "double free of slot {slot:#x}"
        );
        *self.slot_mut(slot) = Slot::Free;
        self.mark_free(slot);
        let c = self.class_of(slot);
        self.pools[c as usize].free.push(slot);
    }

    fn owns_reservation(&self, conn: u64, r: &Reserved) -> bool {
        let (slab, idx) = slot_parts(r.slot);
        self.slabs
            .get(slab as usize)
            .and_then(|s| s.slots.get(idx as usize))
            .is_some_and(|s| matches!(s, Slot::Reserved { conn: c } if *c == conn))
    }

    pub fn commit(
        &mut self,
        conn: u64,
        r: &Reserved,
        meta: Option<&Arc<RouterMeta>>,
        on_lower: bool,
    ) -> CommitStatus {
        if !self.owns_reservation(conn, r) {
            return CommitStatus::UnknownHandle;
        }
        self.totals.reserved -= 1;
        let c = self.class_of(r.slot) as usize;
        self.pools[c].reserved -= 1;
        if self.find(r.ns, &r.key.digest, r.key.segment).is_some() {
            self.free_slot(r.slot);
            return CommitStatus::Duplicate;
        }
        let mut b = Resident::new(r.ns, r.key.digest, r.key.segment, r.len);
        b.set_on_lower(on_lower);
        b.residency = self
            .announcer
            .reside(Medium::CpuPinned, &r.key, meta)
            .map(Box::new);
        *self.slot_mut(r.slot) = Slot::Block(b);
        self.index_insert(r.slot);
        if !on_lower {
            self.queue_write_behind(r.slot, r.key);
        }
        self.pools[c]
            .policy
            .insert(r.slot, key_hash(&r.key), r.hint);
        self.totals.blocks += 1;
        self.totals.bytes += r.len;
        self.totals.inserts += 1;
        let st = &mut self.namespaces[r.ns as usize].stats;
        st.blocks += 1;
        st.bytes += r.len;
        st.inserts += 1;
        CommitStatus::Committed
    }

    pub fn abort(&mut self, conn: u64, r: &Reserved) {
        if self.owns_reservation(conn, r) {
            self.totals.reserved -= 1;
            let c = self.class_of(r.slot) as usize;
            self.pools[c].reserved -= 1;
            self.free_slot(r.slot);
        }
    }

    pub fn lease(&mut self, ns: u32, keys: &[Key]) -> Result<Vec<Option<Leased>>, TierError> {
        self.ns(ns)?;
        let mut out = Vec::with_capacity(keys.len());
        let (mut hits, mut misses) = (0u64, 0u64);
        for (i, k) in keys.iter().enumerate() {
            let Some(slot) = self.find(ns, &k.0, k.1) else {
                misses += 1;
                out.push(None);
                continue;
            };
            hits += 1;
            let offset = self.offset(slot);
            let c = self.class_of(slot) as usize;
            let Slot::Block(r) = self.slot_counters_mut(slot) else {
                unreachable!("indexed slot holds a block")
            };
            r.leases += 1;
            r.count_read();
            let (len, fingerprint) = (r.len, r.fingerprint());
            self.pools[c]
                .policy
                .touch(slot, BatchHint::at(i, keys.len()));
            out.push(Some(Leased {
                slot,
                extent: Extent { offset, len },
                fingerprint,
            }));
        }
        self.totals.hits += hits;
        self.totals.misses += misses;
        self.totals.leases += hits;
        let st = &mut self.namespaces[ns as usize].stats;
        st.hits += hits;
        st.misses += misses;
        Ok(out)
    }

    /// [`State::commit`], keeping `fingerprint` (a checksum the caller verified the bytes
    /// against) with the block when it was committed.
    pub fn commit_checked(
        &mut self,
        owner: u64,
        r: &Reserved,
        meta: Option<&Arc<RouterMeta>>,
        on_lower: bool,
        fingerprint: Option<u64>,
    ) -> CommitStatus {
        let st = self.commit(owner, r, meta, on_lower);
        if let (CommitStatus::Committed, Some(x)) = (st, fingerprint) {
            self.set_checksum(r.slot, x);
        }
        st
    }

    /// Leases the block just committed in `slot` (counted as a hit, as a lookup would be;
    /// `hint` is its place in the batch that reserved it).
    pub fn lease_slot(&mut self, ns: u32, slot: SlotId, hint: BatchHint) -> Leased {
        let offset = self.offset(slot);
        let c = self.class_of(slot) as usize;
        let Slot::Block(r) = self.slot_counters_mut(slot) else {
            unreachable!("a committed slot holds a block")
        };
        r.leases += 1;
        r.count_read();
        let (len, fingerprint) = (r.len, r.fingerprint());
        self.pools[c].policy.touch(slot, hint);
        self.totals.hits += 1;
        self.totals.leases += 1;
        self.namespaces[ns as usize].stats.hits += 1;
        Leased {
            slot,
            extent: Extent { offset, len },
            fingerprint,
        }
    }

    /// Counts `n` misses of namespace `ns` (keys a get found only below DRAM).
    pub fn count_misses(&mut self, ns: u32, n: u64) -> Result<(), TierError> {
        self.ns(ns)?;
        self.totals.misses += n;
        self.namespaces[ns as usize].stats.misses += n;
        Ok(())
    }

    /// Records a block's checksum. The caller knows the slot still holds the block the bytes
    /// were hashed from: it holds a lease on it, or committed it under this same lock.
    pub fn set_checksum(&mut self, slot: SlotId, fingerprint: u64) {
        if let Slot::Block(r) = self.slot_mut(slot) {
            r.set_fingerprint(fingerprint);
        }
    }

    pub fn release(&mut self, slot: SlotId) {
        let Slot::Block(r) = self.slot_counters_mut(slot) else {
            unreachable!("released slot {slot:#x} holds no block: lease bookkeeping is broken")
        };
        assert!(r.leases > 0, "lease count underflow on slot {slot:#x}");
        r.leases -= 1;
        let free = r.leases == 0 && r.doomed;
        self.totals.leases -= 1;
        if free {
            self.free_slot(slot);
        }
    }

    /// Length of each key's block if resident (no lease taken, no policy touched).
    pub fn block_lens(&self, ns: u32, keys: &[Key]) -> Result<Vec<Option<u64>>, TierError> {
        self.ns(ns)?;
        Ok(keys
            .iter()
            .map(|k| match self.find(ns, &k.0, k.1).map(|s| self.slot(s)) {
                Some(Slot::Block(r)) => Some(r.len),
                _ => None,
            })
            .collect())
    }

    pub fn exists(&self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.ns(ns)?;
        let n = keys
            .iter()
            .take_while(|k| self.find(ns, &k.0, k.1).is_some())
            .count();
        Ok(n as u32)
    }

    /// Touches the leading run of `keys` held here in the eviction policy, as a lease of
    /// them would (each at its place in the run), without leasing or counting a read:
    /// returns the run's length.
    pub fn touch(&mut self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.ns(ns)?;
        let mut n = 0;
        for (i, k) in keys.iter().enumerate() {
            let Some(slot) = self.find(ns, &k.0, k.1) else {
                break;
            };
            let c = self.class_of(slot) as usize;
            self.pools[c]
                .policy
                .touch(slot, BatchHint::at(i, keys.len()));
            n += 1;
        }
        self.totals.touched += n;
        Ok(n as u32)
    }

    /// Removes the indexed block in `slot` (delete, clear).
    fn remove_indexed(&mut self, slot: SlotId) {
        let c = self.class_of(slot) as usize;
        self.pools[c].policy.remove(slot);
        self.unindex(slot);
        let Slot::Block(r) = self.slot_mut(slot) else {
            unreachable!("indexed slot holds a block")
        };
        let (ns, len, leases) = (r.ns, r.len, r.leases);
        if leases > 0 {
            r.doomed = true;
        }
        // The block leaves DRAM now, even if a lease keeps its bytes a while longer.
        let residency = r.residency.take();
        self.account_removed(slot, ns, len, false);
        if leases == 0 {
            self.free_slot(slot);
        }
        drop(residency);
    }

    pub fn delete(&mut self, ns: u32, keys: &[Key]) -> Result<u32, TierError> {
        self.ns(ns)?;
        let mut n = 0;
        for k in keys {
            if let Some(slot) = self.find(ns, &k.0, k.1) {
                self.remove_indexed(slot);
                n += 1;
            }
        }
        Ok(n)
    }

    pub fn clear(&mut self, ns: Option<u32>) -> Result<u64, TierError> {
        if let Some(h) = ns {
            self.ns(h)?;
        }
        let slots: Vec<SlotId> = self
            .indexed()
            .filter(|(_, r)| ns.is_none_or(|h| r.ns == h))
            .map(|(s, _)| s)
            .collect();
        for &s in &slots {
            self.remove_indexed(s);
        }
        Ok(slots.len() as u64)
    }

    pub fn snapshot(&self) -> TierSnapshot {
        let mut tier = self.totals.clone();
        tier.capacity_bytes = self.capacity;
        let mut pools = Vec::with_capacity(self.pools.len());
        for p in &self.pools {
            let mut ps = PoolStats {
                class: p.class,
                slot_bytes: p.slot_bytes,
                slabs: p.slabs.len() as u32,
                evictions: p.evictions,
                ..PoolStats::default()
            };
            // Counters, not a walk over the slots: `stats` holds the tier's lock.
            let mut taken = 0;
            for &slab in &p.slabs {
                let s = &self.slabs[slab as usize];
                ps.slots += s.slots.len() as u64;
                taken += u64::from(s.used);
            }
            ps.reserved = p.reserved;
            ps.used = taken - p.reserved;
            ps.free = ps.slots - taken;
            tier.slot_bytes += (ps.used + ps.reserved) * p.slot_bytes;
            pools.push(ps);
        }
        let namespaces = self.namespaces.iter().map(|e| e.stats.clone()).collect();
        TierSnapshot {
            tier,
            pools,
            namespaces,
        }
    }
}
