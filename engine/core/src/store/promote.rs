//! Promotion, the move up from NVMe to DRAM, for one window of a get (prefix.rs):
//!
//! ```text
//!  promote(keys with their planned lengths):
//!    make_room(window bytes) ─> reserve DRAM slots (owner 0)
//!    ─> nvme.submit_read (every read of the window in flight at once)
//!    ─> nvme.finish_read (checksum checked; a miss drops the reservation)
//!    ─> Reservation::commit_leased(on_lower) (a DRAM store event, and the lease, under one lock)
//! ```
//!
//! Runs on a tokio worker in its own task (reads are awaited, never blocked on), so that a
//! dropped request cannot free a slot under an in-flight read.

use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::PutStatus;

use super::prefix::Got;
use super::{Lease, STORE_OWNER, Store};

impl Store {
    /// Reads NVMe-only keys (with their lengths from the plan) into fresh DRAM slots and
    /// commits each leased (announced as DRAM stores): one outcome per key.
    pub(super) async fn promote(
        self: &Arc<Self>,
        ns: u32,
        want: Vec<(usize, Key, u64)>,
    ) -> Vec<(usize, Got)> {
        let (Some(nvme), Ok(id)) = (self.nvme(), self.dram.namespace_id(ns)) else {
            return Vec::new();
        };
        // The window's whole promotion (room made, reads in flight together) is one
        // operation of the NVMe path's cost.
        let mut timing = nvme.promoting();
        let keys: Vec<Key> = want.iter().map(|w| w.1).collect();
        let lens: Vec<u64> = want.iter().map(|w| w.2).collect();
        // Room first, like a put: demote ahead rather than evict blocks without a copy.
        self.make_room(lens.iter().sum()).await;
        let Ok(reserved) = self.reserve(STORE_OWNER, ns, &keys, &lens) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(want.len());
        let mut reads = Vec::new();
        for (w, r) in want.iter().zip(reserved) {
            match r {
                Ok(r) => {
                    let pending = nvme.submit_read(id, &w.1, r.offset(), r.len());
                    reads.push((w.0, w.1, r, pending));
                }
                // Promoted meanwhile by another get: lease that copy.
                Err(PutStatus::Exists) => out.push((w.0, self.lease_one(ns, &w.1))),
                // No free slot, or the tenant's DRAM quota (the length came from the block
                // itself, so a size refusal cannot happen here).
                Err(_) => out.push((w.0, Got::NoRoom)),
            }
        }
        let (mut landed, mut bytes) = (0u64, 0u64);
        for (i, k, mut r, pending) in reads {
            // A miss drops `r`: the slot is freed unpublished.
            let Some(meta) = nvme.finish_read(ns, pending).await else {
                out.push((i, Got::Miss));
                continue;
            };
            r.set_meta(meta);
            bytes += r.len();
            match r.commit_leased(true, None) {
                Some(l) => {
                    landed += 1;
                    out.push((i, Got::Leased(l)));
                }
                // A put of the same key won the race: lease that one.
                None => out.push((i, self.lease_one(ns, &k))),
            }
        }
        timing.moved(bytes);
        nvme.count_promotions(landed);
        self.dram.count_promotions(landed);
        out
    }

    /// Leases one key from DRAM (a copy another writer committed first).
    pub(super) fn lease_one(self: &Arc<Self>, ns: u32, k: &Key) -> Got {
        match self.dram.lease(ns, std::slice::from_ref(k)) {
            Ok(mut l) => l
                .pop()
                .flatten()
                .map_or(Got::Miss, |l| Got::Leased(Lease::new(Arc::clone(self), l))),
            Err(_) => Got::Miss,
        }
    }
}
