//! Delivery in prefix order: the one owner of "the leading pages first, never a hole in
//! front". A prefix cache can use only the leading run of a get, so every path that hands
//! blocks out of the store (inline and lease gets, copies into client regions, GPU onloads, a
//! peer source's pull) takes them through [`Store::prefix`].
//!
//! ```text
//!  Store::prefix(ns, keys, delivery)
//!    plan: one DRAM index visit + one NVMe index visit per key (where, how long)
//!    windows of at most window_bytes (an eighth of DRAM; one window without NVMe)
//!  Prefix::next():  the window promoted ahead ─> outcomes, one per key
//!    DRAM key:  DramTier::lease                         (2nd DRAM visit)
//!    NVMe key:  reserve ─> read ─> commit_leased        (2nd and 3rd DRAM, 2nd NVMe visit)
//!    starts promoting the next window while the caller delivers this one
//! ```
//!
//! Each key gets one [`Got`]: leased, a miss (on no tier, or gone since the plan) or no room
//! (DRAM is full of leased blocks: the prefix ends there). A holding get is also cut before
//! the promotion that would keep more than its limit ([`Store::hold_limit`]). Nothing after
//! the first key with no room or past the limit is leased, so what a caller delivers is
//! always a prefix. No caller asks the store again why a key was not leased.

use std::ops::Range;
use std::sync::Arc;

use kvnode_proto::Key;
use tokio::task::JoinHandle;

use super::{Lease, Location, Store, runs};
use crate::dram::TierError;

/// How often a window waiting for room looks again.
const ROOM_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// How a caller takes the leading pages of a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Window by window: the caller delivers a window and drops it; the next one is promoted
    /// meanwhile. DRAM use stays within two windows whatever the get's length. A window
    /// whose promotion finds no room waits (up to `room_wait_ms`) for other leases to end.
    Stream,
    /// Every window kept, with at most `limit` bytes of promoted blocks (blocks already in
    /// DRAM do not count). `wait`: a key with no room waits (up to `room_wait_ms`) for other
    /// leases to end, as a peer source's pulls do; otherwise the prefix ends there at once.
    Hold {
        /// Promoted bytes the caller may keep.
        limit: u64,
        /// Whether to wait for room held by other leases.
        wait: bool,
    },
}

/// What became of one key.
#[derive(Debug)]
pub enum Got {
    /// Leased: readable until the lease drops.
    Leased(Lease),
    /// On no tier of this node (or gone since the plan: deleted, evicted from NVMe, failed
    /// its checksum). A miss does not end the prefix for the store; the caller decides.
    Miss,
    /// Held on this node, but DRAM has no room for its promotion now (everything there is
    /// leased, or the tenant's DRAM quota is reached). This key and every key after it are
    /// not delivered. (A holding get cut by its limit says so in [`PrefixLease::over_limit`].)
    NoRoom,
}

impl Got {
    /// The lease, if the key was leased.
    pub fn lease(self) -> Option<Lease> {
        match self {
            Got::Leased(l) => Some(l),
            _ => None,
        }
    }

    /// Whether this key ends the prefix (no room).
    pub fn ends_prefix(&self) -> bool {
        matches!(self, Got::NoRoom)
    }
}

/// One window of a get: the outcomes of keys `start..start + got.len()`.
#[derive(Debug)]
pub struct Window {
    /// Index of the window's first key in the get.
    pub start: usize,
    /// One outcome per key of the window.
    pub got: Vec<Got>,
}

impl Window {
    /// The keys of the window, as indexes into the get.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.got.len()
    }

    /// The first key (index into the get) that ends the prefix, if any.
    pub fn end(&self) -> Option<usize> {
        self.got
            .iter()
            .position(Got::ends_prefix)
            .map(|j| self.start + j)
    }
}

/// Leases of a whole get taken in prefix order ([`Prefix::hold`]).
#[derive(Debug)]
pub struct PrefixLease {
    /// One per key; `None` for a miss, and for every key from `short` on.
    pub leases: Vec<Option<Lease>>,
    /// The first key held on this node that could not be leased now: the leading `short`
    /// keys are leased as asked, this one and the rest are not. `None` when everything was.
    pub short: Option<usize>,
    /// `short` is where the hold limit cut the get (rather than DRAM being full).
    pub over_limit: bool,
}

type Ahead = JoinHandle<Result<Vec<Got>, TierError>>;

/// A get in progress, in prefix order (see the module docs).
#[derive(Debug)]
pub struct Prefix {
    store: Arc<Store>,
    ns: u32,
    keys: Arc<[Key]>,
    plan: Vec<(Location, u64)>,
    windows: Vec<Range<usize>>,
    /// Index of the window [`Prefix::next`] returns next.
    next: usize,
    ahead: Option<Ahead>,
    /// Keys from here on are over the hold limit.
    cut: usize,
    wait: bool,
    done: bool,
}

impl Store {
    /// Starts a get of `keys` in prefix order: plans it now (where each key is and how long
    /// its block is), leases nothing until [`Prefix::next`] or [`Prefix::hold`].
    pub fn prefix(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
        delivery: Delivery,
    ) -> Result<Prefix, TierError> {
        let plan = self.held(ns, keys)?;
        let (cut, wait) = match delivery {
            Delivery::Stream => (keys.len(), true),
            Delivery::Hold { limit, wait } => (hold_cut(&plan, limit), wait),
        };
        let windows = if self.nvme().is_none() || plan.is_empty() {
            std::iter::once(0..cut).collect()
        } else {
            runs(plan[..cut].iter().map(|p| p.1), self.window_bytes())
        };
        Ok(Prefix {
            store: Arc::clone(self),
            ns,
            keys: keys.into(),
            plan,
            windows,
            next: 0,
            ahead: None,
            cut,
            wait,
            done: false,
        })
    }

    /// Where each key is and its block length (0 when absent), without leasing anything.
    pub fn held(&self, ns: u32, keys: &[Key]) -> Result<Vec<(Location, u64)>, TierError> {
        let lens = self.dram.block_lens(ns, keys)?;
        let id = self.dram.namespace_id(ns)?;
        Ok(keys
            .iter()
            .zip(lens)
            .map(|(k, l)| match (l, self.nvme()) {
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

    /// Holds every key on this node in prefix order with the default [`Store::hold_limit`]
    /// ([`Delivery::Hold`], then [`Prefix::hold`]). `wait`: a key with no room waits (up to
    /// `room_wait_ms`) for other leases to end.
    pub async fn hold(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
        wait: bool,
    ) -> Result<PrefixLease, TierError> {
        let delivery = Delivery::Hold {
            limit: self.hold_limit(),
            wait,
        };
        self.prefix(ns, keys, delivery)?.hold().await
    }

    /// Holds every key on this node, waiting for room held by other leases (a peer source's
    /// pulls run side by side and free their blocks as they are sent): [`Store::hold`]'s
    /// leases. A key that still cannot be leased is `None`, and so is every key after it.
    pub async fn lease(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
    ) -> Result<Vec<Option<Lease>>, TierError> {
        Ok(self.hold(ns, keys, true).await?.leases)
    }

    /// How long a window waits for DRAM room held by other leases (`room_wait_ms`).
    fn room_wait(&self) -> std::time::Duration {
        self.nvme()
            .map_or(std::time::Duration::ZERO, |n| n.room_wait())
    }

    /// Leases one window: DRAM keys at once, NVMe keys promoted (room made for their bytes,
    /// as a put makes it), waiting for room up to `room_wait_ms` when `wait`.
    async fn window(
        self: Arc<Self>,
        ns: u32,
        keys: Arc<[Key]>,
        plan: Vec<(Location, u64)>,
        wait: bool,
    ) -> Result<Vec<Got>, TierError> {
        let mut got = self.take(ns, &keys, &plan).await?;
        let deadline = tokio::time::Instant::now() + self.room_wait();
        while wait && tokio::time::Instant::now() < deadline {
            let Some(s) = got.iter().position(|g| matches!(g, Got::NoRoom)) else {
                break;
            };
            tokio::time::sleep(ROOM_POLL).await;
            let again = self.take(ns, &keys[s..], &plan[s..]).await?;
            got.truncate(s);
            got.extend(again);
        }
        Ok(cut_at_no_room(got))
    }

    /// One try at a window: leases what is in DRAM, promotes what the plan found on NVMe.
    async fn take(
        self: &Arc<Self>,
        ns: u32,
        keys: &[Key],
        plan: &[(Location, u64)],
    ) -> Result<Vec<Got>, TierError> {
        let in_dram: Vec<usize> = (0..keys.len())
            .filter(|&i| plan[i].0 == Location::Dram)
            .collect();
        let dram_keys: Vec<Key> = in_dram.iter().map(|&i| keys[i]).collect();
        let mut got: Vec<Got> = (0..keys.len()).map(|_| Got::Miss).collect();
        let mut lower: Vec<(usize, Key, u64)> = Vec::new();
        for (&i, l) in in_dram.iter().zip(self.dram.lease(ns, &dram_keys)?) {
            match l {
                Some(l) => got[i] = Got::Leased(Lease::new(Arc::clone(self), l)),
                // Evicted since the plan: it may have been demoted, so NVMe is asked.
                None => lower.extend(self.nvme_len(ns, &keys[i]).map(|len| (i, keys[i], len))),
            }
        }
        // Planned on NVMe: DRAM is not asked again (its miss is counted here).
        let planned_lower = lower.len();
        lower.extend(
            (0..keys.len())
                .filter(|&i| plan[i].0 == Location::Nvme)
                .map(|i| (i, keys[i], plan[i].1)),
        );
        self.dram
            .count_misses(ns, (lower.len() - planned_lower) as u64)?;
        if !lower.is_empty() {
            // Its own task: a dropped request cannot strand a slot under an in-flight read.
            let s = Arc::clone(self);
            let promoted = tokio::spawn(async move { s.promote(ns, lower).await })
                .await
                .unwrap_or_default();
            for (i, g) in promoted {
                got[i] = g;
            }
        }
        Ok(got)
    }

    /// The block length of a key on NVMe, if it is there.
    fn nvme_len(&self, ns: u32, k: &Key) -> Option<u64> {
        let id = self.dram.namespace_id(ns).ok()?;
        self.nvme()?.block_len(id, k)
    }
}

/// Where a hold limit cuts a get: before the first promotion that would pass it.
fn hold_cut(plan: &[(Location, u64)], limit: u64) -> usize {
    let mut promoted = 0u64;
    plan.iter()
        .position(|&(at, len)| {
            if at != Location::Nvme {
                return false;
            }
            promoted = promoted.saturating_add(len);
            promoted > limit
        })
        .unwrap_or(plan.len())
}

/// After the first key with no room, nothing is leased: later leases are dropped.
fn cut_at_no_room(mut got: Vec<Got>) -> Vec<Got> {
    if let Some(s) = got.iter().position(|g| matches!(g, Got::NoRoom)) {
        got[s..].iter_mut().for_each(|g| *g = Got::NoRoom);
    }
    got
}

impl Prefix {
    /// Where each key is and its block length (0 when on no tier), as planned.
    pub fn plan(&self) -> &[(Location, u64)] {
        &self.plan
    }

    /// Whether the get takes more than one window (it streams).
    pub fn is_streamed(&self) -> bool {
        self.windows.len() > 1
    }

    /// The next window's outcomes, in order; `None` once every window was returned or a
    /// window ended the prefix. Starts promoting the window after it before returning.
    pub async fn next(&mut self) -> Result<Option<Window>, TierError> {
        if self.done || self.next >= self.windows.len() {
            return Ok(None);
        }
        let range = self.windows[self.next].clone();
        let ahead = self
            .ahead
            .take()
            .unwrap_or_else(|| self.start(range.clone()));
        self.next += 1;
        // A panic ends the daemon (docs/operations.md); a cancelled task reads as misses.
        let got = ahead
            .await
            .unwrap_or_else(|_| Ok((0..range.len()).map(|_| Got::Miss).collect()))?;
        let window = Window {
            start: range.start,
            got,
        };
        if window.end().is_some() {
            self.done = true;
        } else if let Some(r) = self.windows.get(self.next).cloned() {
            self.ahead = Some(self.start(r));
        }
        Ok(Some(window))
    }

    /// Starts leasing (and promoting) keys `range` in their own task.
    fn start(&self, range: Range<usize>) -> Ahead {
        let store = Arc::clone(&self.store);
        let keys: Arc<[Key]> = self.keys[range.clone()].into();
        let plan = self.plan[range].to_vec();
        tokio::spawn(store.window(self.ns, keys, plan, self.wait))
    }

    /// Takes every window, keeping all of them: a prefix of leases.
    pub async fn hold(mut self) -> Result<PrefixLease, TierError> {
        let n = self.keys.len();
        let mut leases: Vec<Option<Lease>> = Vec::with_capacity(n);
        let mut short = None;
        while let Some(w) = self.next().await? {
            short = w.end();
            leases.extend(w.got.into_iter().map(Got::lease));
        }
        if short.is_none() && self.cut < n {
            short = Some(self.cut);
        }
        if let Some(s) = short {
            leases.truncate(s);
        }
        leases.resize_with(n, || None);
        Ok(PrefixLease {
            over_limit: short.is_some_and(|s| s == self.cut && self.cut < n),
            leases,
            short,
        })
    }
}
