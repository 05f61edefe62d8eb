//! kvnode-cluster: cluster membership on etcd (docs/cluster.md). Each daemon registers a
//! record under `/kvnode/clusters/NAME/members/NODE_ID` attached to a lease it keeps alive;
//! a watch of that prefix keeps a [`View`] of the live members, which the daemon consults to
//! authorize hinted endpoints. The crate knows nothing of the engine.
//!
//! ```text
//!   daemon ──start(ClusterConfig, Registration)──> agent task ──gRPC──> etcd
//!                                                   │ lease + record, keep-alive, watch
//!                                                   v
//!   hint path ──View::check(host, port)──> Verdict   (memory only, never waits on etcd)
//!   stats / metrics / `kvnode cluster` <── View::summary / View::report
//! ```
//!
//! - [`config`]: `[cluster]` settings and the `etcd://HOST:PORT,.../NAME` URL.
//! - [`record`]: the member record stored in etcd.
//! - [`view`]: the live membership, its states and verdicts.
//! - [`agent`]: registration, keep-alive, watch, reconnects.
//! - [`connect`]: etcd connection options (timeouts, user/password, TLS).
//! - [`error`]: the crate's error type, [`ClusterError`].

pub mod agent;
pub mod config;
pub mod connect;
pub mod error;
pub mod record;
pub mod view;

pub use agent::{Agent, Registration, start};
pub use config::{ClusterConfig, EtcdUrl};
pub use error::ClusterError;
pub use record::MemberRecord;
pub use view::{Verdict, View};
