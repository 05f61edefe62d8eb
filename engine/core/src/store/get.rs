//! Gets in prefix order. A prefix cache can use only the leading run of a get, so the
//! leading pages are located, promoted and delivered first, and a get never answers with a
//! hole at the front while later pages are served.
//!
//! - [`Store::plan`] says, without leasing, where each key is and how long its block is.
//! - [`Store::windows`] cuts the keys into windows of at most [`Store::window_bytes`]
//!   (an eighth of the DRAM tier): one window is promoted and leased at a time.
//! - Streaming callers (inline gets, copies into client buffers and regions) lease a
//!   window, deliver it, drop it and go on: bounded DRAM use, any length.
//! - Holding callers (lease-mode gets, GPU onloads, a peer source's pull) use
//!   [`Store::lease_prefix`]: windows in order, every earlier window kept; it stops at the
//!   first held key that cannot be leased now, so what it returns is always a prefix.

use std::ops::Range;
use std::sync::Arc;

use kvnode_proto::Key;

use super::{Lease, Location, Store, runs};
use crate::dram::TierError;

/// Leases of a get taken in prefix order.
#[derive(Debug)]
pub struct PrefixLease {
    /// One per key; `None` for a miss, and for every key from `short` on.
    pub leases: Vec<Option<Lease>>,
    /// The first key held on this node that could not be leased now (no room for its
    /// promotion within the hold limit or in DRAM): the leading `short` keys are leasable
    /// as asked, this one and the rest are not leased. `None` when everything was.
    pub short: Option<usize>,
    /// `short` is where the hold limit cut the get (rather than DRAM being full).
    pub over_limit: bool,
}

/// How often a lease waiting for room looks again.
const ROOM_POLL: std::time::Duration = std::time::Duration::from_millis(5);

impl Store {
    /// Where each key is and its block length (0 when absent), without leasing anything.
    pub fn plan(&self, ns: u32, keys: &[Key]) -> Result<Vec<(Location, u64)>, TierError> {
        let lens = self.dram.block_lens(ns, keys)?;
        let id = self.dram.namespace_id(ns)?;
        Ok(keys
            .iter()
            .zip(lens)
            .map(|(k, l)| match (l, &self.nvme) {
                (Some(l), _) => (Location::Dram, l),
                (None, Some(n)) => n
                    .block_len(id, k)
                    .map_or((Location::Absent, 0), |l| (Location::Nvme, l)),
                (None, None) => (Location::Absent, 0),
            })
            .collect())
    }

    /// Bytes one window of a get (or one run of a put) may take at once: an eighth of the
    /// DRAM tier, at least one byte (a window always has at least one block).
    pub fn window_bytes(&self) -> u64 {
        (self.dram.free_and_capacity().1 / 8).max(1)
    }

    /// Bytes of promotions one holding get may keep leased: half the DRAM tier, so that
    /// one request cannot pin the whole tier. Blocks already in DRAM do not count.
    pub fn hold_limit(&self) -> u64 {
        self.dram.free_and_capacity().1 / 2
    }

    /// Consecutive windows over a plan. Without an NVMe tier nothing is promoted, so the
    /// whole get is one window.
    pub fn windows(&self, plan: &[(Location, u64)]) -> Vec<Range<usize>> {
        if self.nvme.is_none() || plan.is_empty() {
            return std::iter::once(0..plan.len()).collect();
        }
        runs(plan.iter().map(|p| p.1), self.window_bytes())
    }

    /// Leases every key held on this node, in prefix order (see [`Store::lease_prefix`]
    /// with the default [`Store::hold_limit`]). When DRAM has no room because everything
    /// in it is leased, the leased prefix is kept and the rest is tried again as leases
    /// end, for at most `room_wait_ms` (a peer source's pulls run side by side and free
    /// their blocks as they are sent). A key that still cannot be leased is `None`, and so
    /// is every key after it.
    pub async fn lease(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
    ) -> Result<Vec<Option<Lease>>, TierError> {
        let mut got = self.lease_prefix(ns, keys, self.hold_limit()).await?;
        let deadline = tokio::time::Instant::now() + self.room_wait();
        while let Some(s) = got.short {
            if got.over_limit || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(ROOM_POLL).await;
            let more = self.lease_prefix(ns, &keys[s..], self.hold_limit()).await?;
            got.over_limit = more.over_limit;
            got.short = more.short.map(|m| s + m);
            for (slot, l) in got.leases[s..].iter_mut().zip(more.leases) {
                *slot = l;
            }
        }
        Ok(got.leases)
    }

    /// Leases keys window by window in order, keeping every earlier window, with at most
    /// `hold_limit` bytes of promoted blocks. Stops at the first key held on this node
    /// that cannot be leased: the promotion would pass `hold_limit`, or DRAM has no room
    /// (everything else is leased). A key that vanished meanwhile (deleted, evicted from
    /// NVMe, failed its checksum) is a miss and does not stop it.
    pub async fn lease_prefix(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
        hold_limit: u64,
    ) -> Result<PrefixLease, TierError> {
        let plan = self.plan(ns, keys)?;
        // The hold limit cuts the get before the first promotion that would pass it.
        let mut promoted = 0u64;
        let cut = plan
            .iter()
            .position(|&(at, len)| {
                if at != Location::Nvme {
                    return false;
                }
                promoted = promoted.saturating_add(len);
                promoted > hold_limit
            })
            .unwrap_or(keys.len());
        let mut leases: Vec<Option<Lease>> = Vec::with_capacity(keys.len());
        let mut short = (cut < keys.len()).then_some(cut);
        for w in self.windows(&plan[..cut]) {
            let got = self.lease_window(ns, &keys[w.clone()]).await?;
            for (i, l) in w.clone().zip(got) {
                if short.is_some_and(|s| i >= s) {
                    break;
                }
                if l.is_none() && plan[i].0.is_local() && self.still_local(ns, &keys[i]) {
                    short = Some(i);
                    break;
                }
                leases.push(l);
            }
            if short.is_some_and(|s| s < cut) {
                break;
            }
        }
        leases.resize_with(keys.len(), || None);
        let over_limit = short == Some(cut) && cut < keys.len();
        Ok(PrefixLease {
            leases,
            short,
            over_limit,
        })
    }

    /// How long a lease waits for DRAM room held by other leases (`room_wait_ms`).
    fn room_wait(&self) -> std::time::Duration {
        self.nvme
            .as_ref()
            .map_or(std::time::Duration::ZERO, |n| n.room_wait())
    }

    /// Whether a key is still on this node (after a lease of it failed: then it failed
    /// for room, not because it is gone).
    pub fn still_local(&self, ns: u32, k: &Key) -> bool {
        self.locate(ns, std::slice::from_ref(k))
            .is_ok_and(|l| l[0].is_local())
    }
}
