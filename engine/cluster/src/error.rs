//! Errors of the cluster agent.

use std::time::Duration;

/// Why a cluster setting or an etcd session failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A `[cluster]` setting that cannot work.
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    /// A credential or certificate file could not be read.
    #[error("cannot read {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// TLS to etcd was asked for but this build has no TLS.
    #[error(
        "etcds:// needs TLS, and this kvnode was built without it (the `kvnode` crate's default feature `cluster-tls`)"
    )]
    NoTls,
    /// An etcd request failed (unreachable, refused, authentication).
    #[error("etcd {what} failed: {source}")]
    Etcd {
        /// Which request.
        what: &'static str,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("etcd {0} timed out after {1:?} (etcd down or partitioned?)")]
    Timeout(&'static str, Duration),
    /// This daemon's lease is gone (expired while etcd was unreachable, or etcd lost it).
    #[error("lease {0:x} expired or was revoked: registering again")]
    LeaseLost(i64),
    /// A stream from etcd (keep-alive or watch) ended.
    #[error("etcd {0} stream ended")]
    StreamEnded(&'static str),
    /// The watch was cancelled by etcd (e.g. its revision was compacted).
    #[error("etcd cancelled the membership watch: {0}")]
    WatchCancelled(String),
}

impl ClusterError {
    /// Wraps an etcd client error.
    pub fn etcd(what: &'static str) -> impl FnOnce(etcd_client::Error) -> Self {
        move |source| ClusterError::Etcd { what, source }
    }
}
