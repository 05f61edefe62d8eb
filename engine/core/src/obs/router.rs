//! The router entry's counters (`stats.router`, `/metrics` `kvnode_router_requests_total`),
//! kept by the engine and counted by the entry (`api::RouterGate`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use kvnode_proto::stats::RouterStats;

/// How the router entry's requests ended.
#[derive(Debug, Default)]
pub struct RouterCounters {
    /// The entry is serving.
    pub serving: AtomicBool,
    /// Authenticated and run.
    pub accepted: AtomicU64,
    /// Refused for their signature.
    pub refused_auth: AtomicU64,
    /// Refused for their timing (window, replay, busy).
    pub refused_replay: AtomicU64,
    /// Refused for their content.
    pub refused_invalid: AtomicU64,
}

impl RouterCounters {
    /// The counters as reported (the resolve counters are the peer service's).
    pub fn report(&self) -> RouterStats {
        RouterStats {
            serving: self.serving.load(Relaxed),
            accepted: self.accepted.load(Relaxed),
            refused_auth: self.refused_auth.load(Relaxed),
            refused_replay: self.refused_replay.load(Relaxed),
            refused_invalid: self.refused_invalid.load(Relaxed),
            ..RouterStats::default()
        }
    }
}
