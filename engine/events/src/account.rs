//! Accounts: whose events hold the publisher's memory, and how much each may hold.
//!
//! Every queued event and every batch kept for replay holds bytes outside the arena. A
//! sink call names the [`Account`] (the daemon keeps one per tenant) its event is charged
//! to; the charge lives as long as the bytes do and is given back on drop (RAII):
//!
//! ```text
//!  sink ──QueueCharge (global queue bytes + account.queued)──> publisher thread
//!        drop when the batch is on the wire ─┘     └─> RingShare (account.ring) per batch
//!                                                       drop when the ring evicts the batch
//! ```
//!
//! Bounds: `account.queued <= limit` (a store past it is dropped, counted on the account),
//! and `account.ring <= limit` (the ring evicts its oldest batches until it holds). A
//! removal is never refused for its account's budget (it is smaller than the store it
//! follows, and dropping it would leave the router pointing at a block that is gone); it
//! still counts against the global queue bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::stats::{Counters, bump};

/// One party's (a tenant's) share of the publisher's memory.
#[derive(Debug)]
pub struct Account {
    name: String,
    limit: u64,
    queued: AtomicU64,
    ring: AtomicU64,
    dropped: AtomicU64,
}

/// A point-in-time copy of an account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountStats {
    /// The account's name (the tenant's).
    pub name: String,
    /// Bytes it may hold in the queue, and again in the replay ring.
    pub limit: u64,
    /// Bytes of its events waiting for the publisher thread.
    pub queued_bytes: u64,
    /// Bytes of its events kept for replay.
    pub ring_bytes: u64,
    /// Its stores dropped because its queue share was full.
    pub dropped: u64,
}

impl Account {
    /// An account named `name` that may hold `limit` bytes queued and `limit` in the ring.
    pub fn new(name: impl Into<String>, limit: u64) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            limit,
            queued: AtomicU64::new(0),
            ring: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        })
    }

    /// The account's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The counters now.
    pub fn stats(&self) -> AccountStats {
        AccountStats {
            name: self.name.clone(),
            limit: self.limit,
            queued_bytes: self.queued.load(Relaxed),
            ring_bytes: self.ring.load(Relaxed),
            dropped: self.dropped.load(Relaxed),
        }
    }

    pub(crate) fn count_drop(&self) {
        bump(&self.dropped, 1);
    }

    pub(crate) fn ring_over_limit(&self) -> bool {
        self.ring.load(Relaxed) > self.limit
    }
}

/// Adds `bytes` to `ledger` if the sum stays within `limit`; else changes nothing.
fn try_add(ledger: &AtomicU64, bytes: u64, limit: u64) -> bool {
    ledger
        .fetch_update(Relaxed, Relaxed, |v| {
            v.checked_add(bytes).filter(|&sum| sum <= limit)
        })
        .is_ok()
}

/// Why a queue charge was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The publisher's queue is at its byte bound.
    Global,
    /// The account's share of the queue is full.
    Account,
}

/// Bytes of one queued event: on the global queue ledger and on its account's.
#[derive(Debug)]
pub(crate) struct QueueCharge {
    counters: Arc<Counters>,
    account: Option<Arc<Account>>,
    bytes: u64,
}

impl QueueCharge {
    /// Charges `bytes` to the queue (bounded by `queue_limit`) and, when `enforce_account`,
    /// to the account's queue share too.
    pub(crate) fn try_new(
        counters: &Arc<Counters>,
        account: Option<&Arc<Account>>,
        bytes: u64,
        queue_limit: u64,
        enforce_account: bool,
    ) -> Result<Self, Refused> {
        if let Some(a) = account {
            let limit = if enforce_account { a.limit } else { u64::MAX };
            if !try_add(&a.queued, bytes, limit) {
                return Err(Refused::Account);
            }
        }
        if !try_add(&counters.queued_bytes, bytes, queue_limit) {
            if let Some(a) = account {
                a.queued.fetch_sub(bytes, Relaxed);
            }
            return Err(Refused::Global);
        }
        Ok(Self {
            counters: Arc::clone(counters),
            account: account.cloned(),
            bytes,
        })
    }

    /// The account charged, and the bytes: what the ring charges the same event.
    pub(crate) fn share(&self) -> Option<(&Arc<Account>, u64)> {
        self.account.as_ref().map(|a| (a, self.bytes))
    }
}

impl Drop for QueueCharge {
    fn drop(&mut self) {
        self.counters.queued_bytes.fetch_sub(self.bytes, Relaxed);
        if let Some(a) = &self.account {
            a.queued.fetch_sub(self.bytes, Relaxed);
        }
    }
}

/// Bytes of an account's events inside one batch kept for replay.
#[derive(Debug)]
pub(crate) struct RingShare {
    account: Arc<Account>,
    bytes: u64,
}

impl RingShare {
    pub(crate) fn new(account: &Arc<Account>, bytes: u64) -> Self {
        account.ring.fetch_add(bytes, Relaxed);
        Self {
            account: Arc::clone(account),
            bytes,
        }
    }

    pub(crate) fn account(&self) -> &Arc<Account> {
        &self.account
    }
}

impl Drop for RingShare {
    fn drop(&mut self) {
        self.account.ring.fetch_sub(self.bytes, Relaxed);
    }
}

/// One ring share per account, summing the `(account, bytes)` of a batch's events.
pub(crate) fn ring_shares<'a>(
    items: impl Iterator<Item = (&'a Arc<Account>, u64)>,
) -> Vec<RingShare> {
    let mut out: Vec<(Arc<Account>, u64)> = Vec::new();
    for (a, b) in items {
        match out.iter_mut().find(|(x, _)| Arc::ptr_eq(x, a)) {
            Some((_, sum)) => *sum += b,
            None => out.push((Arc::clone(a), b)),
        }
    }
    out.iter().map(|(a, b)| RingShare::new(a, *b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_charges_respect_both_bounds_and_give_back_on_drop() {
        let counters = Arc::new(Counters::default());
        let a = Account::new("a", 100);
        let c1 = QueueCharge::try_new(&counters, Some(&a), 60, 1000, true).unwrap();
        assert_eq!(
            QueueCharge::try_new(&counters, Some(&a), 60, 1000, true).unwrap_err(),
            Refused::Account
        );
        // A removal is not held to the account's share, only to the global bound.
        let c2 = QueueCharge::try_new(&counters, Some(&a), 60, 1000, false).unwrap();
        assert_eq!(
            QueueCharge::try_new(&counters, None, 900, 1000, true).unwrap_err(),
            Refused::Global
        );
        assert_eq!(a.stats().queued_bytes, 120);
        drop((c1, c2));
        assert_eq!(a.stats().queued_bytes, 0);
        assert_eq!(counters.queued_bytes.load(Relaxed), 0);
    }

    #[test]
    fn ring_shares_merge_per_account_and_release_on_drop() {
        let a = Account::new("a", 10);
        let b = Account::new("b", 10);
        let shares = ring_shares([(&a, 4), (&b, 1), (&a, 8)].into_iter());
        assert_eq!(shares.len(), 2);
        assert!(a.ring_over_limit() && !b.ring_over_limit());
        drop(shares);
        assert_eq!((a.stats().ring_bytes, b.stats().ring_bytes), (0, 0));
    }
}
