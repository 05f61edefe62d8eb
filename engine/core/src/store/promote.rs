//! Promotion, the move up from NVMe to DRAM: one window of a get at a time.
//!
//! ```text
//!  lease_window: DramTier::lease (hits) ─> misses ─> promote:
//!    nvme.block_len ─> make_room(window bytes) ─> reserve DRAM slots (owner 0)
//!    ─> nvme.submit_read (every read of the window in flight at once)
//!    ─> nvme.finish_read (checksum checked; a miss drops the reservation)
//!    ─> Reservation::commit_as(on_lower) (a DRAM store event) ─> DramTier::lease
//! ```
//!
//! Runs on a tokio worker (reads are awaited, never blocked on); the promotion itself runs
//! in its own task so that a dropped request cannot free a slot under an in-flight read.

use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::CommitStatus;

use super::{Lease, STORE_OWNER, Store};
use crate::dram::TierError;

impl Store {
    /// Leases one window of keys: DRAM hits at once, NVMe-only keys promoted into DRAM
    /// first (room made for the window's bytes, as a put makes it). Misses are `None`. The
    /// caller keeps a window small (see [`Store::window_bytes`]): every promoted block of it
    /// needs a free slot at the same time.
    pub async fn lease_window(
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
        if want.is_empty() {
            return Vec::new();
        }
        let keys: Vec<Key> = want.iter().map(|w| w.1).collect();
        let lens: Vec<u64> = want.iter().map(|w| w.2).collect();
        // Room first, like a put: demote ahead rather than evict blocks without a copy.
        self.make_room(lens.iter().sum()).await;
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
}
