//! Block residencies: a `Residency` announces its block's store on creation and its removal on drop.
//!
//! Every KV event the engine publishes comes from here. A tier that holds a block with known
//! tokens owns one [`Residency`] per (tier, block); creating it publishes `BlockStored`, and
//! dropping it (eviction, demotion, delete, clear, doomed-while-leased) publishes
//! `BlockRemoved` with the same medium. So each residency yields exactly one store and one
//! remove, whatever path ends it. `clear` of everything publishes `AllBlocksCleared` and
//! advances an epoch, which silences the drops of residencies announced before it.
//!
//! Ordering against a clear: a store publishes its event and reads the epoch, a drop
//! compares the epoch and publishes its removal, each while holding the epoch lock for
//! reading; a clear advances the epoch and publishes `AllBlocksCleared` holding it for
//! writing. So every store or removal lands entirely before or entirely after a clear on
//! the wire, and a router never sees a removal whose store a clear already wiped.
//!
//! Snapshots: the announcer keeps a registry of every (medium, block) it announced and has
//! not yet removed, updated under the same read lock as the event. A snapshot holds the
//! lock for writing while it copies the registry (Arcs only) and queues a marker, so the
//! copy is exactly what the wire said up to the marker (see `kvnode_events::snapshot`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use kvnode_events::snapshot::{Entry, Marker};
use kvnode_events::{Account, Announced, BlockStored, EventSink, Medium, SnapshotSource};
use kvnode_proto::client::BlockMeta;
use kvnode_proto::peer::PeerMeta;
use kvnode_proto::{BlockKey, Digest, NamespaceId, NamespaceSpec};

pub mod policy;
pub mod settings;

use policy::{Decision, Policy};

/// What the router needs to announce one block, shared by all its residencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterMeta {
    /// Router hash of the block (first 8 digest bytes, big-endian).
    pub hash: u64,
    /// Router hash of the parent block, `None` for a chain root.
    pub parent: Option<u64>,
    /// Exact tokens of the block.
    pub tokens: Vec<u32>,
    /// Tokens per block (the namespace's page size).
    pub block_size: u32,
    /// Tenant salt, if the namespace has one.
    pub salt: Option<String>,
    /// The bytes this metadata holds, charged to its tenant's metadata ledger while it
    /// lives (`None`: charged to nobody, e.g. metadata taken over from a previous daemon).
    pub charge: Option<MetaCharge>,
}

/// A tenant's live router metadata may take 1/this of its DRAM allowance.
pub const META_SHARE: u64 = 16;

/// What one namespace's router metadata is charged to: its tenant's ledger, limited to
/// 1/[`META_SHARE`] of the tenant's DRAM allowance (its `dram_quota`, else the tier).
#[derive(Debug)]
pub struct MetaBudget {
    /// The namespace's spec (page size, salt).
    pub spec: NamespaceSpec,
    /// The tenant's name (for logs).
    pub tenant: String,
    ledger: Arc<AtomicU64>,
    limit: u64,
}

impl MetaBudget {
    /// The budget of a tenant with `ledger`, DRAM allowance `allowance`.
    pub fn new(
        spec: NamespaceSpec,
        tenant: String,
        ledger: Arc<AtomicU64>,
        allowance: u64,
    ) -> Self {
        Self {
            spec,
            tenant,
            ledger,
            limit: allowance / META_SHARE,
        }
    }

    /// The budget's limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Charges `bytes`, or `None` when they do not fit.
    pub fn charge(&self, bytes: u64) -> Option<MetaCharge> {
        MetaCharge::try_new(&self.ledger, bytes, self.limit)
    }
}

/// Bytes of router metadata held against a ledger (a tenant's), given back on drop.
#[derive(Debug)]
pub struct MetaCharge {
    ledger: Arc<AtomicU64>,
    bytes: u64,
}

impl MetaCharge {
    /// Charges `bytes` to `ledger` if it stays within `limit`; `None` (nothing charged)
    /// otherwise.
    pub fn try_new(ledger: &Arc<AtomicU64>, bytes: u64, limit: u64) -> Option<Self> {
        let before = ledger.fetch_add(bytes, Relaxed);
        if before + bytes > limit {
            ledger.fetch_sub(bytes, Relaxed);
            return None;
        }
        Some(Self {
            ledger: Arc::clone(ledger),
            bytes,
        })
    }
}

impl Clone for MetaCharge {
    /// A copy is charged again (each copy gives its bytes back when dropped).
    fn clone(&self) -> Self {
        self.ledger.fetch_add(self.bytes, Relaxed);
        Self {
            ledger: Arc::clone(&self.ledger),
            bytes: self.bytes,
        }
    }
}

impl Drop for MetaCharge {
    fn drop(&mut self) {
        self.ledger.fetch_sub(self.bytes, Relaxed);
    }
}

impl PartialEq for MetaCharge {
    /// Charges say nothing about the metadata itself: metadata compares by content.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for MetaCharge {}

impl RouterMeta {
    /// Heap and inline bytes this metadata takes (what its tenant is charged).
    pub fn footprint(tokens: usize, salt: Option<&str>) -> u64 {
        (std::mem::size_of::<Self>() + 4 * tokens + salt.map_or(0, str::len)) as u64
    }

    /// Builds the metadata of a block of namespace `spec`; `None` when the client gave no
    /// tokens or their count is not the page size (such a block would be rejected anyway).
    /// With a `charge`, the metadata is charged to it (`None` when that fails: the block
    /// is then stored without metadata).
    pub fn from_client(
        spec: &NamespaceSpec,
        hash: u64,
        meta: Option<&BlockMeta>,
        charge: impl FnOnce(u64) -> Option<MetaCharge>,
    ) -> Option<Arc<Self>> {
        let m = meta?;
        Self::charged(
            spec,
            hash,
            &m.tokens,
            m.parent.map(|d| d.router_hash()),
            charge,
        )
    }

    /// Builds the metadata of a block pulled from a peer, from what the source announced
    /// it with (untrusted: `None` unless its token count is the page size), charged as
    /// [`RouterMeta::from_client`] charges.
    pub fn from_peer(
        spec: &NamespaceSpec,
        hash: u64,
        meta: &PeerMeta,
        charge: impl FnOnce(u64) -> Option<MetaCharge>,
    ) -> Option<Arc<Self>> {
        Self::charged(spec, hash, &meta.tokens, meta.parent, charge)
    }

    fn charged(
        spec: &NamespaceSpec,
        hash: u64,
        tokens: &[u32],
        parent: Option<u64>,
        charge: impl FnOnce(u64) -> Option<MetaCharge>,
    ) -> Option<Arc<Self>> {
        if tokens.is_empty() || tokens.len() != spec.page_size as usize {
            return None;
        }
        let salt = (!spec.tenant_salt.is_empty()).then_some(spec.tenant_salt.as_str());
        let charge = Some(charge(Self::footprint(tokens.len(), salt))?);
        Some(Arc::new(Self {
            hash,
            parent,
            tokens: tokens.to_vec(),
            block_size: spec.page_size,
            salt: salt.map(str::to_owned),
            charge,
        }))
    }
}

impl Announced for RouterMeta {
    fn hash(&self) -> u64 {
        self.hash
    }

    fn parent(&self) -> Option<u64> {
        self.parent
    }

    /// The one place a block's store is built, live or in a snapshot.
    fn stored(&self, medium: Medium) -> BlockStored {
        BlockStored::new(medium, self.block_size)
            .with_parent(self.parent)
            .with_salt(self.salt.clone())
            .block(self.hash, &self.tokens)
    }
}

/// Every (medium, block) announced and not yet removed: what a snapshot copies, and what a
/// router may name by hash. A slab: each live residency owns one slot (the medium, the
/// block's key and an `Arc` of the metadata its residencies already share), freed slots
/// are reused; `by_hash` orders the slots by router hash (about 24 bytes a residency).
#[derive(Debug, Default)]
struct Registry {
    slots: Vec<Option<(Medium, Arc<RouterMeta>, BlockKey)>>,
    free: Vec<u32>,
    by_hash: BTreeSet<(u64, u32)>,
    /// The slots announced on NVMe: a hand-over lists them without walking every DRAM
    /// block's slot.
    disk: BTreeSet<u32>,
}

/// A registry a hand-over retired: every block it lists was handed to a successor. Dropping
/// it frees each entry (tens of milliseconds per million blocks); a daemon that exits next
/// leaves it to the kernel ([`Retired::leave`]).
#[derive(Debug, Default)]
pub struct Retired {
    /// Held only to be freed (or left) as a whole.
    _entries: Registry,
}

impl Retired {
    /// Leaves the memory to the process's exit instead of freeing entry by entry.
    pub fn leave(self) {
        std::mem::forget(self);
    }
}

impl Registry {
    fn insert(&mut self, medium: Medium, meta: Arc<RouterMeta>, key: BlockKey) -> u32 {
        let hash = meta.hash;
        let entry = Some((medium, meta, key));
        let slot = if let Some(slot) = self.free.pop() {
            self.slots[slot as usize] = entry;
            slot
        } else {
            self.slots.push(entry);
            u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 residencies")
        };
        self.by_hash.insert((hash, slot));
        if medium == Medium::Disk {
            self.disk.insert(slot);
        }
        slot
    }

    fn remove(&mut self, slot: u32) {
        if let Some(s) = self.slots.get_mut(slot as usize)
            && let Some((medium, meta, _)) = s.take()
        {
            self.by_hash.remove(&(meta.hash, slot));
            if medium == Medium::Disk {
                self.disk.remove(&slot);
            }
            self.free.push(slot);
        }
    }

    fn copy(&self) -> Vec<Entry> {
        self.slots
            .iter()
            .flatten()
            .map(|(m, meta, _)| (*m, Arc::clone(meta) as Arc<dyn Announced>))
            .collect()
    }

    /// The metadata page `digest` of namespace `ns` was announced with, in any medium.
    fn meta(&self, ns: NamespaceId, digest: &Digest) -> Option<Arc<RouterMeta>> {
        let hash = digest.router_hash();
        self.by_hash
            .range((hash, 0)..=(hash, u32::MAX))
            .filter_map(|&(_, slot)| self.slots[slot as usize].as_ref())
            .find(|(_, _, k)| k.ns == ns && k.digest == *digest)
            .map(|(_, m, _)| Arc::clone(m))
    }

    /// The page digest announced under `hash` in namespace `ns`, in any medium.
    fn digest(&self, ns: NamespaceId, hash: u64) -> Option<Digest> {
        self.by_hash
            .range((hash, 0)..=(hash, u32::MAX))
            .filter_map(|&(_, slot)| self.slots[slot as usize].as_ref())
            .find(|(_, _, k)| k.ns == ns)
            .map(|(_, _, k)| k.digest)
    }
}

/// Publishes residency events; cheap to share. Without a sink it announces nothing.
#[derive(Debug, Default)]
pub struct Announcer {
    sink: OnceLock<Out>,
    /// Events are on: a sink is attached, or will be ([`Announcer::pending`]); until then
    /// blocks are registered and their residencies' drops unregister them, nothing is sent.
    events: bool,
    /// Clears so far; see the module doc for why publishing happens under this lock.
    epoch: RwLock<u64>,
    /// What is announced now (only with a sink); changed only under `epoch`.
    registry: Mutex<Registry>,
    /// Whose blocks are announced, charged to which account.
    policy: Policy,
    /// While set ([`Announcer::adopting`]), blocks made resident are registered without
    /// their store being published.
    quiet: AtomicBool,
}

/// Blocks made resident while this lives are adopted: registered as announced, their store
/// not published (a takeover's blocks, which the predecessor announced on the stream this
/// daemon continues). Dropping it ends that.
#[derive(Debug)]
pub struct Adopting<'a>(&'a Announcer);

impl Drop for Adopting<'_> {
    fn drop(&mut self) {
        self.0.quiet.store(false, Relaxed);
    }
}

/// What a successor needs to continue the event stream (`Announcer::hand_over`).
#[derive(Debug)]
pub struct HandedOver {
    /// The seq of its first batch.
    pub seq: u64,
    /// The blocks announced on NVMe, with their metadata (the spill files carry none).
    pub nvme: Vec<(BlockKey, Arc<RouterMeta>)>,
    /// The blocks announced in DRAM (a restart's successor finds them on NVMe, if the
    /// stop-time flush copied them, and announces the move); empty unless asked for (a
    /// takeover's successor has them from the DRAM image).
    pub dram: Vec<(BlockKey, Arc<RouterMeta>)>,
    /// The registry as it was.
    pub retired: Retired,
}

/// Where events go: the publisher's sink, or (unit tests) a recorder.
#[derive(Debug)]
enum Out {
    Sink(EventSink),
    #[cfg(test)]
    Record(Arc<record::Recorder>),
}

impl Out {
    /// Whether the store was queued (a rejected or dropped event is counted and logged by
    /// the sink, and gets no residency: no removal follows a store never published).
    fn stored(&self, account: Option<&Arc<Account>>, ev: BlockStored) -> bool {
        match self {
            Self::Sink(s) => s.stored_as(account, ev).is_ok(),
            #[cfg(test)]
            Self::Record(r) => {
                r.stored(&ev);
                true
            }
        }
    }

    fn removed(&self, account: Option<&Arc<Account>>, medium: Medium, hash: u64) {
        match self {
            Self::Sink(s) => drop(s.removed_as(account, medium, vec![hash])),
            #[cfg(test)]
            Self::Record(r) => r.removed(hash),
        }
    }

    fn cleared(&self) {
        match self {
            Self::Sink(s) => drop(s.cleared()),
            #[cfg(test)]
            Self::Record(r) => r.cleared(),
        }
    }
}

impl Announcer {
    /// An announcer publishing every block through `sink` (or nothing).
    pub fn new(sink: Option<EventSink>) -> Arc<Self> {
        Self::with_policy(sink, Policy::all())
    }

    /// An announcer publishing through `sink` the blocks `policy` allows.
    /// It serves the publisher's residency snapshots.
    pub fn with_policy(sink: Option<EventSink>, policy: Policy) -> Arc<Self> {
        let events = sink.is_some();
        let a = Self::of(policy, events);
        if let Some(s) = sink {
            a.attach(s);
        }
        a
    }

    /// An announcer whose sink comes later ([`Announcer::attach`]): a live takeover's
    /// successor builds its DRAM tier from the donor's image while the donor serves and
    /// publishes, before this daemon's publisher can start (it continues the donor's seq,
    /// known only at the barrier). Until the sink is attached, blocks made resident are
    /// registered (the donor announced them) and residencies dropped (slots the donor
    /// changed meanwhile) are unregistered; nothing is published.
    pub fn pending(policy: Policy) -> Arc<Self> {
        Self::of(policy, true)
    }

    fn of(policy: Policy, events: bool) -> Arc<Self> {
        Arc::new(Self {
            sink: OnceLock::new(),
            events,
            epoch: RwLock::new(0),
            registry: Mutex::default(),
            policy,
            quiet: AtomicBool::new(false),
        })
    }

    /// Attaches the sink of a [`Announcer::pending`] announcer (or of `with_policy`): from
    /// now on stores and removals are published, and it serves the publisher's residency
    /// snapshots. A second sink is refused.
    pub fn attach(self: &Arc<Self>, sink: EventSink) -> bool {
        debug_assert!(self.events, "attach on an announcer without events");
        let weak: std::sync::Weak<Self> = Arc::downgrade(self);
        if self.sink.set(Out::Sink(sink)).is_err() {
            return false;
        }
        if let Some(Out::Sink(s)) = self.sink.get() {
            s.serve_snapshots(weak as std::sync::Weak<dyn SnapshotSource>);
        }
        true
    }

    /// Publishes the store of every block registered so far: a live takeover's blocks when
    /// the donor's stream could not be continued (this daemon starts a new one). Returns
    /// how many were published.
    pub fn announce_registered(&self) -> usize {
        let Some(sink) = self.sink.get() else {
            return 0;
        };
        let _epoch = self.epoch_read();
        let reg = self.registry();
        let mut n = 0;
        for (medium, meta, _) in reg.slots.iter().flatten() {
            if let Decision::Publish(account) = self.policy.decide(meta.salt.as_deref())
                && sink.stored(account, meta.stored(*medium))
            {
                n += 1;
            }
        }
        n
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn epoch_read(&self) -> std::sync::RwLockReadGuard<'_, u64> {
        self.epoch.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether events are published at all.
    pub fn enabled(&self) -> bool {
        self.sink.get().is_some()
    }

    /// Block `key` became resident in `medium`: publishes `BlockStored` and returns the
    /// residency whose drop publishes the removal. `None` without a sink or metadata, when
    /// the block's tenant does not publish, or when the store was not queued.
    pub fn reside(
        self: &Arc<Self>,
        medium: Medium,
        key: &BlockKey,
        meta: Option<&Arc<RouterMeta>>,
    ) -> Option<Residency> {
        self.reside_as(medium, key, meta, true)
    }

    /// Like [`Announcer::reside`] for one block a predecessor announced: registered as
    /// announced, never published (whatever other blocks are doing meanwhile).
    pub fn reside_adopted(
        self: &Arc<Self>,
        medium: Medium,
        key: &BlockKey,
        meta: &Arc<RouterMeta>,
    ) -> Option<Residency> {
        self.reside_as(medium, key, Some(meta), false)
    }

    fn reside_as(
        self: &Arc<Self>,
        medium: Medium,
        key: &BlockKey,
        meta: Option<&Arc<RouterMeta>>,
        publish: bool,
    ) -> Option<Residency> {
        if !self.events {
            return None;
        }
        let meta = Arc::clone(meta?);
        let Decision::Publish(account) = self.policy.decide(meta.salt.as_deref()) else {
            return None;
        };
        let epoch = self.epoch_read();
        // No sink yet (pending): registered only, as when adopting.
        if let Some(sink) = self.sink.get()
            && publish
            && !self.quiet.load(Relaxed)
            && !sink.stored(account, meta.stored(medium))
        {
            return None;
        }
        let slot = self.registry().insert(medium, Arc::clone(&meta), *key);
        Some(Residency {
            announcer: Arc::clone(self),
            account: account.cloned(),
            meta,
            medium,
            epoch: *epoch,
            slot,
        })
    }

    /// For each router hash, the page digest this node announced under it in namespace `ns`
    /// (in any medium), or `None`: what a router or a peer that knows blocks only by the
    /// hashes of the events may name. Nothing resolves without events (nothing was
    /// announced), nor for a tenant whose blocks are not published.
    pub fn resolve(&self, ns: NamespaceId, hashes: &[u64]) -> Vec<Option<Digest>> {
        let r = self.registry();
        hashes.iter().map(|&h| r.digest(ns, h)).collect()
    }

    /// The router metadata this node announced page `digest` of namespace `ns` with (in
    /// any medium), or `None`: what a peer pulling the page announces it with in turn.
    pub fn meta_of(&self, ns: NamespaceId, digest: &Digest) -> Option<Arc<RouterMeta>> {
        self.registry().meta(ns, digest)
    }

    /// Until the guard drops, blocks made resident are adopted: registered as announced, not
    /// published again (a takeover that continues the predecessor's event stream).
    pub fn adopting(&self) -> Adopting<'_> {
        self.quiet.store(true, Relaxed);
        Adopting(self)
    }

    /// A successor continues this daemon's event stream (a takeover, docs/events.md
    /// "Takeover"): silences every residency announced so far (the successor adopts the DRAM
    /// tier's blocks from the image and the NVMe tier's from the list returned here, without
    /// announcing them again) and returns the seq of the successor's first batch, once every
    /// event queued before is sent (at most `limit`). `None` without events, or when the
    /// publisher did not answer in time (then nothing is silenced). The DRAM blocks are
    /// listed only `with_dram` (a restart; a takeover's successor has them from the image):
    /// a takeover's barrier then walks only the NVMe announcements, not every block.
    pub async fn hand_over(
        &self,
        limit: std::time::Duration,
        with_dram: bool,
    ) -> Option<HandedOver> {
        let Some(Out::Sink(sink)) = self.sink.get() else {
            return None;
        };
        let (rx, nvme, dram, retired) = {
            let mut epoch = self.epoch.write().unwrap_or_else(PoisonError::into_inner);
            // Queued while no event can be: the seq it learns follows every one published.
            let rx = sink.next_seq()?;
            let mut reg = self.registry();
            let entry = |slot: &Option<(Medium, Arc<RouterMeta>, BlockKey)>| {
                slot.as_ref().map(|(_, meta, key)| (*key, Arc::clone(meta)))
            };
            let nvme = reg
                .disk
                .iter()
                .filter_map(|&slot| reg.slots.get(slot as usize).and_then(entry))
                .collect();
            let dram = if with_dram {
                reg.slots
                    .iter()
                    .filter(|s| s.as_ref().is_some_and(|(m, _, _)| *m == Medium::CpuPinned))
                    .filter_map(entry)
                    .collect()
            } else {
                Vec::new()
            };
            *epoch += 1;
            (
                rx,
                nvme,
                dram,
                Retired {
                    _entries: std::mem::take(&mut *reg),
                },
            )
        };
        if let Ok(Ok(seq)) = tokio::time::timeout(limit, rx).await {
            return Some(HandedOver {
                seq,
                nvme,
                dram,
                retired,
            });
        }
        tracing::warn!(
            ?limit,
            "the KV event publisher did not confirm its last seq: the successor starts a new stream"
        );
        None
    }

    /// Publishes that block `meta` left `medium`, for a block announced by a predecessor
    /// that this daemon does not hold after all (a takeover's NVMe block the spill tier no
    /// longer has).
    pub fn retract(&self, medium: Medium, meta: &RouterMeta) {
        let Some(sink) = self.sink.get() else { return };
        if let Decision::Publish(account) = self.policy.decide(meta.salt.as_deref()) {
            let _epoch = self.epoch_read();
            sink.removed(account, medium, meta.hash);
        }
    }

    /// Everything is gone: publishes `AllBlocksCleared`; residencies announced before this
    /// call end silently.
    pub fn clear_all(&self) {
        if let Some(sink) = self.sink.get() {
            let mut epoch = self.epoch.write().unwrap_or_else(PoisonError::into_inner);
            *epoch += 1;
            *self.registry() = Registry::default();
            sink.cleared();
        }
    }

    /// The publisher's counters, if events are on.
    pub fn stats(&self) -> Option<kvnode_events::Stats> {
        match self.sink.get()? {
            Out::Sink(s) => Some(s.stats()),
            #[cfg(test)]
            Out::Record(_) => None,
        }
    }

    /// The events report for `stats` and `/metrics`, if events are on.
    pub fn report(&self) -> Option<kvnode_proto::stats::EventsStats> {
        let s = self.stats()?;
        Some(kvnode_proto::stats::EventsStats {
            published: s.events_total(),
            batches: s.batches,
            bytes: s.bytes,
            dropped_queue_full: s.dropped_full,
            dropped_tenant_budget: s.dropped_account,
            dropped_closed: s.dropped_closed,
            rejected: s.rejected_total(),
            withheld: self.policy.withheld(),
            queued_bytes: s.queued_bytes,
            replay_ring_bytes: s.ring_bytes,
            replay_ring_batches: s.ring_batches,
            replay_ring_evicted: s.ring_evicted,
            replay_requests: s.replay_requests,
            replay_bad_requests: s.replay_bad_requests,
            snapshots: s.snapshots,
            snapshot_blocks: s.snapshot_blocks,
            tenants: self
                .policy
                .accounts()
                .into_iter()
                .map(|a| kvnode_proto::stats::EventsTenantStats {
                    name: a.name,
                    limit_bytes: a.limit,
                    queued_bytes: a.queued_bytes,
                    replay_ring_bytes: a.ring_bytes,
                    dropped: a.dropped,
                })
                .collect(),
        })
    }
}

impl SnapshotSource for Announcer {
    /// Holds the epoch lock for writing (no store or removal is between its event and its
    /// registry change), copies the registry's Arcs and queues the marker behind them.
    fn snapshot(&self, marker: Marker) -> Result<Vec<Entry>, Marker> {
        let Some(Out::Sink(sink)) = self.sink.get() else {
            return Err(marker);
        };
        let _epoch = self.epoch.write().unwrap_or_else(PoisonError::into_inner);
        let entries = self.registry().copy();
        sink.mark(marker)?;
        Ok(entries)
    }
}

/// One block resident in one tier; dropping it announces the block left that tier.
#[derive(Debug)]
pub struct Residency {
    announcer: Arc<Announcer>,
    /// The account its store was charged to; its removal is charged there too.
    account: Option<Arc<Account>>,
    meta: Arc<RouterMeta>,
    medium: Medium,
    epoch: u64,
    /// Its slot in the announcer's registry (void once `epoch` is past).
    slot: u32,
}

impl Residency {
    /// The block's router metadata (to announce it in another tier).
    pub fn meta(&self) -> &Arc<RouterMeta> {
        &self.meta
    }
}

impl Drop for Residency {
    fn drop(&mut self) {
        let epoch = self.announcer.epoch_read();
        if *epoch == self.epoch {
            // No sink yet (pending): the donor announced this block's removal.
            if let Some(sink) = self.announcer.sink.get() {
                sink.removed(self.account.as_ref(), self.medium, self.meta.hash);
            }
            self.announcer.registry().remove(self.slot);
        }
    }
}

#[cfg(test)]
mod record;
