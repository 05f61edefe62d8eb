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
