//! Fair shares of a peer's cap on keys in flight (`max_outstanding_keys`) among tenants.
//!
//! A link's cap is shared by every tenant pulling from that peer. Alone, a tenant may fill
//! it. While other tenants have keys in flight to the same peer, a tenant is still admitted
//! when the link is full, as long as its own keys stay within its fair share, `cap / tenants
//! with keys in flight` (itself included): so one tenant's flood of hinted gets or `Exists`
//! cannot refuse another's pulls. The flooding tenant, over its share, is admitted only
//! while the link has room. The link then holds at most twice the cap (the fair-share
//! admissions above it are bounded by that too), and comes back under the cap as the
//! flood's keys are answered.
//!
//! A tenant's keys are counted from admission until each is answered or its op ends
//! ([`Share`], held by the op); the link's own count (`PeerLink::outstanding`) runs per
//! chunk and stays the authority for the cap. Keys the link still counts that no live op
//! claims (an ended op's chunk still on the wire) count as one more party, so a tenant
//! arriving just as a flood's op ends is not refused for keys that are nobody's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvnode_proto::pull::{FailCode, Failure};

use crate::tenant::TenantId;

/// What admission needs of a peer link (`fetch::PeerLink`): its name and its count of
/// keys in flight, the authority for the cap.
#[derive(Clone, Copy, Debug)]
pub struct LinkCount<'a> {
    /// `tcp://host:port`.
    pub name: &'a str,
    /// Keys requested and not yet answered or failed.
    pub outstanding: &'a AtomicU64,
}

/// Keys in flight per peer and tenant.
#[derive(Debug, Default)]
pub struct FairShares {
    by_peer: Mutex<HashMap<String, HashMap<TenantId, u64>>>,
}

/// `n` keys of one tenant in flight to one peer; each is given back as it is answered
/// ([`Share::release`]) and the rest when dropped.
#[derive(Debug)]
pub struct Share {
    table: Arc<FairShares>,
    peer: String,
    tenant: TenantId,
    n: u64,
}

impl FairShares {
    /// Counts `n` keys of `tenant` in flight to `link` (both on the link and as the
    /// tenant's), unless that passes `cap` and the tenant's fair share (module doc).
    pub fn admit(
        self: &Arc<Self>,
        link: LinkCount<'_>,
        tenant: TenantId,
        n: u64,
        cap: u32,
    ) -> Result<Share, Failure> {
        let cap = u64::from(cap);
        let mut m = self.by_peer.lock().unwrap_or_else(PoisonError::into_inner);
        let tenants = m.entry(link.name.to_owned()).or_default();
        let own = tenants.get(&tenant).copied().unwrap_or(0);
        let before = link.outstanding.fetch_add(n, Ordering::Relaxed);
        // Keys still on the wire for ops that have ended (their chunk has not finished yet)
        // belong to no tenant here: together they count as one more party.
        let stale = before.saturating_sub(tenants.values().sum());
        let others = tenants.len() - usize::from(own > 0) + usize::from(stale > 0);
        let active = others as u64 + 1;
        let share = (cap / active).max(1);
        let fits = before + n <= cap;
        let fair = others > 0 && own + n <= share && before + n <= 2 * cap;
        if !fits && !fair {
            link.outstanding.fetch_sub(n, Ordering::Relaxed);
            if tenants.is_empty() {
                m.remove(link.name);
            }
            let msg = if others > 0 {
                format!(
                    "peer {} already has {before} keys in flight (limit {cap}), {own} of them this tenant's, whose fair share is {share} ({active} tenants pulling from it): not adding {n} more",
                    link.name
                )
            } else {
                format!(
                    "peer {} already has {before} keys in flight (limit {cap}): not adding {n} more",
                    link.name
                )
            };
            return Err(Failure::new(FailCode::PeerBusy, msg));
        }
        *tenants.entry(tenant).or_default() += n;
        Ok(Share {
            table: Arc::clone(self),
            peer: link.name.to_owned(),
            tenant,
            n,
        })
    }

    /// Keys of `tenant` in flight to `peer` (tests and reports).
    pub fn held(&self, peer: &str, tenant: TenantId) -> u64 {
        let m = self.by_peer.lock().unwrap_or_else(PoisonError::into_inner);
        m.get(peer)
            .and_then(|t| t.get(&tenant))
            .copied()
            .unwrap_or(0)
    }

    fn give_back(&self, peer: &str, tenant: TenantId, k: u64) {
        let mut m = self.by_peer.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tenants) = m.get_mut(peer) else {
            return;
        };
        if let Some(n) = tenants.get_mut(&tenant) {
            *n = n.saturating_sub(k);
            if *n == 0 {
                tenants.remove(&tenant);
            }
        }
        if tenants.is_empty() {
            m.remove(peer);
        }
    }
}

impl Share {
    /// Gives back `k` keys (answered).
    pub fn release(&mut self, k: u64) {
        let k = k.min(self.n);
        if k > 0 {
            self.n -= k;
            self.table.give_back(&self.peer, self.tenant, k);
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let n = self.n;
        self.release(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Link {
        name: String,
        outstanding: AtomicU64,
    }

    impl Link {
        fn count(&self) -> LinkCount<'_> {
            LinkCount {
                name: &self.name,
                outstanding: &self.outstanding,
            }
        }
    }

    fn link() -> Link {
        Link {
            name: "tcp://127.0.0.1:1".into(),
            outstanding: AtomicU64::new(0),
        }
    }

    #[test]
    fn a_lone_tenant_fills_the_cap_and_no_more() {
        let (t, l) = (Arc::new(FairShares::default()), link());
        let a = t.admit(l.count(), 0, 8, 8).unwrap();
        assert_eq!(
            t.admit(l.count(), 0, 1, 8).unwrap_err().code,
            FailCode::PeerBusy
        );
        drop(a);
        assert_eq!(t.held(&l.name, 0), 0);
    }

    #[test]
    fn a_flood_cannot_refuse_another_tenant_its_fair_share() {
        let (t, l) = (Arc::new(FairShares::default()), link());
        // B fills the link alone.
        let b = t.admit(l.count(), 2, 8, 8).unwrap();
        // A is admitted up to half the cap although the link is full...
        let mut a = t.admit(l.count(), 1, 4, 8).unwrap();
        assert_eq!(
            t.admit(l.count(), 1, 1, 8).unwrap_err().code,
            FailCode::PeerBusy
        );
        // ...and B, over its share, is refused while A pulls.
        assert_eq!(
            t.admit(l.count(), 2, 1, 8).unwrap_err().code,
            FailCode::PeerBusy
        );
        assert_eq!(l.outstanding.load(Ordering::Relaxed), 12);
        // A's answered keys come back one by one.
        a.release(4);
        assert_eq!(t.held(&l.name, 1), 0);
        // B's op ends with its chunk still on the wire: A, alone in the table, still gets
        // its share of the full link.
        drop(b);
        assert!(t.admit(l.count(), 1, 4, 8).is_ok());
        let b = t.admit(l.count(), 2, 1, 8);
        drop((a, b));
        l.outstanding.store(0, Ordering::Relaxed);
        assert!(t.admit(l.count(), 2, 8, 8).is_ok());
    }
}
