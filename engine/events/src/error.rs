//! Errors: starting a publisher, and submitting an event through a sink.

use crate::validate::Rejection;

/// Why a [`Publisher`](crate::Publisher) could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublisherError {
    /// A config field is out of range; the message names the field and the fix.
    #[error("invalid KV events config: {field} {problem}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it and what to use instead.
        problem: String,
    },
    /// Binding a socket failed (port in use, bad address, no such interface).
    #[error("cannot bind the KV events {socket} socket to {endpoint}: {source}")]
    Bind {
        /// `"PUB"` or `"replay ROUTER"`.
        socket: &'static str,
        /// The endpoint as configured.
        endpoint: String,
        /// The transport's error.
        source: zeromq::ZmqError,
    },
    /// An `ipc://` socket could not be created safely (directory others may write, a
    /// file in the way, a group the daemon is not in).
    #[error("cannot bind the KV events {socket} socket: {source}")]
    Ipc {
        /// `"PUB"` or `"replay ROUTER"`.
        socket: &'static str,
        /// What went wrong and what to change.
        source: crate::ipc::IpcError,
    },
    /// The runtime or thread that owns the sockets could not be created.
    #[error("cannot start the KV events thread: {0}")]
    Start(#[source] std::io::Error),
    /// The publisher thread ended before reporting that its sockets were bound.
    #[error("the KV events thread exited during startup")]
    StartupAborted,
}

/// Why a sink did not queue an event. The caller is never blocked; each outcome is counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The event breaks a wire rule and was not queued (counted per reason).
    #[error("KV event rejected: {0}")]
    Rejected(#[from] Rejection),
    /// The queue to the publisher thread is full; the event was dropped (counted). Raise
    /// `queue_capacity` or lower the event rate; the router's view is stale until the
    /// affected blocks' next store or remove.
    #[error("KV event queue is full; event dropped")]
    QueueFull,
    /// The event's account (its tenant) already holds its share of the queue; the store
    /// was dropped (counted on the account and in `dropped_account`). The block is not
    /// announced; its removal will not be either.
    #[error("the tenant's share of the KV event queue is full; store dropped")]
    AccountFull,
    /// The publisher has shut down; the event was dropped (counted).
    #[error("KV event publisher is shut down; event dropped")]
    Closed,
}
