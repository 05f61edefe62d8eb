//! RAII guards over DRAM slots: a [`Lease`] keeps a block readable, a [`Reservation`] keeps a
//! slot writable by one owner. Dropping a guard ends it (release, or abort); committing a
//! reservation consumes it. No code outside this file releases or aborts a slot.

use std::sync::Arc;

use kvnode_proto::BlockKey;
use kvnode_proto::client::{CommitStatus, Extent};

use super::Store;
use crate::dram::{Leased, Reserved};
use crate::residency::RouterMeta;

/// A leased, committed, immutable block. Its slot is neither evicted nor reused until the
/// lease drops.
#[derive(Debug)]
pub struct Lease {
    store: Arc<Store>,
    raw: Leased,
}

impl Lease {
    pub(super) fn new(store: Arc<Store>, raw: Leased) -> Self {
        Self { store, raw }
    }

    /// Where the bytes are in the arena.
    pub fn extent(&self) -> Extent {
        self.raw.extent
    }

    /// Block length in bytes.
    pub fn len(&self) -> u64 {
        self.raw.extent.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.extent.len == 0
    }

    /// The block's fingerprint (first 8 bytes of the BLAKE3 hash of its bytes, `peer::hashes`),
    /// if it was computed before (blocks are immutable, so it stays true).
    pub fn fingerprint(&self) -> Option<u64> {
        self.raw.fingerprint
    }

    /// The block's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: a leased block is committed and immutable, and its slot is not reused
        // until this lease drops; the arena outlives the store this lease holds.
        unsafe {
            self.store
                .arena
                .slice(self.raw.extent.offset, self.raw.extent.len)
        }
    }

    /// Keeps a checksum computed over [`Lease::bytes`] with the block.
    pub fn remember_checksum(&self, fingerprint: u64) {
        self.store.dram.remember_checksum(&self.raw, fingerprint);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.store.dram.release(&[self.raw.slot]);
    }
}

/// A DRAM slot reserved for one writer. Dropped without [`Reservation::commit`], the slot
/// is freed and nothing is published.
#[derive(Debug)]
pub struct Reservation {
    store: Arc<Store>,
    owner: u64,
    raw: Option<Reserved>,
    meta: Option<Arc<RouterMeta>>,
}

impl Reservation {
    pub(super) fn new(store: Arc<Store>, owner: u64, raw: Reserved) -> Self {
        Self {
            store,
            owner,
            raw: Some(raw),
            meta: None,
        }
    }

    fn raw(&self) -> &Reserved {
        self.raw
            .as_ref()
            .expect("a live reservation holds its slot")
    }

    /// Arena byte offset of the slot.
    pub fn offset(&self) -> u64 {
        self.raw().offset
    }

    /// Bytes the writer must fill.
    pub fn len(&self) -> u64 {
        self.raw().len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.raw().len == 0
    }

    /// Namespace handle.
    pub fn ns(&self) -> u32 {
        self.raw().ns
    }

    /// The key the slot will hold.
    pub fn key(&self) -> BlockKey {
        self.raw().key
    }

    /// Router metadata to announce the block with when it is committed.
    pub fn set_meta(&mut self, meta: Option<Arc<RouterMeta>>) {
        self.meta = meta;
    }

    /// The slot's bytes, for the writer.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let r = *self.raw();
        // SAFETY: a reserved slot is written by its one owner (this guard, borrowed
        // mutably) and read by no one until it is committed; the arena outlives the store.
        unsafe { self.store.arena.slice_mut(r.offset, r.len) }
    }

    /// Publishes the slot as a block.
    pub fn commit(self) -> CommitStatus {
        self.commit_as(false, None)
    }

    /// Publishes the slot as a block whose bytes the caller verified against `fingerprint`; the
    /// checksum is kept so sending the block on need not hash it again.
    pub fn commit_verified(self, fingerprint: u64) -> CommitStatus {
        self.commit_as(false, Some(fingerprint))
    }

    /// [`Reservation::commit_verified`] that also leases the block in the same step, for a
    /// caller that hands it on (a pulled block an onload copies): `None` when it was not
    /// committed.
    pub fn commit_verified_leased(self, fingerprint: u64) -> Option<Lease> {
        self.commit_leased(false, Some(fingerprint))
    }

    /// Publishes the slot and leases the block in the same step (no second lookup, and no
    /// eviction between the two): `None` when it was not committed (a block of the same key
    /// was committed first; the slot is freed). `on_lower` and `fingerprint` as in
    /// [`Reservation::commit_as`].
    pub(super) fn commit_leased(
        mut self,
        on_lower: bool,
        fingerprint: Option<u64>,
    ) -> Option<Lease> {
        let raw = self.raw.take().expect("a live reservation holds its slot");
        let got = self.store.dram.commit_leased(
            self.owner,
            &raw,
            self.meta.as_ref(),
            on_lower,
            fingerprint,
        );
        self.store.quota_release(raw.ns, raw.len);
        got.map(|l| Lease::new(Arc::clone(&self.store), l))
    }

    /// Publishes the slot; `on_lower` marks a block promoted from the tier below.
    pub(super) fn commit_as(mut self, on_lower: bool, fingerprint: Option<u64>) -> CommitStatus {
        let raw = self.raw.take().expect("a live reservation holds its slot");
        let st =
            self.store
                .dram
                .commit_one(self.owner, &raw, self.meta.as_ref(), on_lower, fingerprint);
        self.store.quota_release(raw.ns, raw.len);
        st
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.store.dram.abort(self.owner, &[raw]);
            self.store.quota_release(raw.ns, raw.len);
        }
    }
}
