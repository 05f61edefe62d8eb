//! The seam through which cluster membership (docs/cluster.md) authorizes hinted endpoints
//! next to the static allowlist. The daemon sets one implementation at start-up (the etcd
//! agent of `kvnode-cluster`); the engine knows nothing of etcd.
//!
//! Contract: every method answers from memory, at once. Nothing here may wait on the
//! membership store: the pull path calls [`Membership::authorize`] before any dial, and a
//! slow or partitioned etcd must never slow a hint down.

use std::fmt;

use kvnode_proto::cluster::{ClusterReport, ClusterSummary};
use kvnode_proto::hint::Endpoint;
use kvnode_proto::pull::Failure;

/// A live membership view.
pub trait Membership: Send + Sync + fmt::Debug {
    /// `Ok` when `e` is the advertised endpoint of a live, compatible member and the
    /// membership is in force; otherwise the refusal a client sees (its message says why:
    /// not a member, an incompatible peer protocol, membership expired).
    fn authorize(&self, e: &Endpoint) -> Result<(), Failure>;
    /// Health in one line (`stats`, `/metrics`).
    fn summary(&self) -> ClusterSummary;
    /// Health and every live member (`cluster` op).
    fn report(&self) -> ClusterReport;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use kvnode_proto::pull::FailCode;

    use super::*;
    use crate::arena::Arena;
    use crate::dram::{DramTier, TierConfig};
    use crate::obs::Metrics;
    use crate::peer::{PeerConfig, Peers};
    use crate::policy::PolicyKind;
    use crate::residency::Announcer;
    use crate::store::Store;

    /// Admits exactly one endpoint.
    #[derive(Debug)]
    struct One(Endpoint);

    impl Membership for One {
        fn authorize(&self, e: &Endpoint) -> Result<(), Failure> {
            if *e == self.0 {
                Ok(())
            } else {
                Err(Failure::new(
                    FailCode::NotAuthorized,
                    format!("{e} is not a live member"),
                ))
            }
        }
        fn summary(&self) -> ClusterSummary {
            ClusterSummary::default()
        }
        fn report(&self) -> ClusterReport {
            ClusterReport::default()
        }
    }

    fn peers(allow: &[&str]) -> Peers {
        let arena = Arc::new(Arena::create(8 << 20, false).expect("arena"));
        let announcer = Announcer::new(None);
        let dram = Arc::new(DramTier::with_announcer(
            &TierConfig {
                capacity: arena.len(),
                slab_bytes: 2 << 20,
                policy: PolicyKind::Lru,
            },
            Arc::clone(&announcer),
        ));
        let store = Store::new(arena, dram, None, announcer);
        let key =
            std::env::temp_dir().join(format!("kvnode-membership-{}.key", std::process::id()));
        std::fs::write(&key, "membership-test-key-0123456789").unwrap();
        let cfg = PeerConfig {
            cluster_key: Some(key.clone()),
            listen: Some("10.0.0.1:7700".into()),
            peers: allow.iter().map(|s| (*s).to_owned()).collect(),
            ..PeerConfig::default()
        };
        let p = Peers::new(&cfg, store, Arc::new(Metrics::default())).expect("peers");
        let _ = std::fs::remove_file(key);
        p
    }

    fn ep(s: &str) -> Endpoint {
        Endpoint::parse(s).unwrap()
    }

    #[test]
    fn membership_admits_live_members_next_to_the_static_allowlist() {
        let p = peers(&["tcp://10.0.0.9:7700"]);
        // Without a membership: only --peers.
        assert!(p.authorize(&ep("tcp://10.0.0.9:7700")).is_ok());
        let e = p.authorize(&ep("tcp://10.0.0.2:7700")).unwrap_err();
        assert!(e.message.contains("not in --peers"), "{e:?}");
        p.set_membership(Arc::new(One(ep("tcp://10.0.0.2:7700"))))
            .unwrap();
        assert!(
            p.set_membership(Arc::new(One(ep("tcp://x:1")))).is_err(),
            "set once"
        );
        assert!(p.authorize(&ep("tcp://10.0.0.2:7700")).is_ok());
        assert!(
            p.authorize(&ep("tcp://10.0.0.9:7700")).is_ok(),
            "static entries still apply"
        );
        let e = p.authorize(&ep("tcp://10.0.0.3:7700")).unwrap_err();
        assert_eq!(e.code, FailCode::NotAuthorized);
        assert!(e.message.contains("not a live member"), "{e:?}");
        assert_eq!(p.counters.refused_members.load(Ordering::Relaxed), 1);
        // The daemon itself is refused before membership is asked.
        assert!(p.authorize(&ep("tcp://10.0.0.1:7700")).is_err());
        assert_eq!(p.counters.refused_members.load(Ordering::Relaxed), 1);
    }
}
