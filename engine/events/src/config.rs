//! Publisher configuration, every default documented.

use std::time::Duration;

use crate::endpoint::Endpoint;
use crate::error::PublisherError;

/// Default for [`PublisherConfig::max_batch_events`]: small, so one bad batch (the router
/// drops a batch whole) could hide at most this many events.
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 64;
/// Default for [`PublisherConfig::flush_interval`].
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(2);
/// Default for [`PublisherConfig::replay_ring_len`] (`SGLang` keeps the same number).
pub const DEFAULT_REPLAY_RING_LEN: usize = 10_000;
/// Default for [`PublisherConfig::replay_ring_bytes`]: 10 000 batches of 64 single-block
/// stores of 16 tokens each take about this much.
pub const DEFAULT_REPLAY_RING_BYTES: u64 = 64 << 20;
/// Default for [`PublisherConfig::queue_capacity`].
pub const DEFAULT_QUEUE_CAPACITY: usize = 65_536;
/// Default for [`PublisherConfig::queue_bytes`].
pub const DEFAULT_QUEUE_BYTES: u64 = 64 << 20;
/// Default for [`PublisherConfig::linger`].
pub const DEFAULT_LINGER: Duration = Duration::from_millis(100);
pub use crate::ipc::{Access, DEFAULT_IPC_MODE};

/// How a [`Publisher`](crate::Publisher) binds and batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// `ipc://PATH` or `tcp://HOST:PORT` the PUB socket binds (a tcp port 0 picks a free
    /// port; see [`Publisher::endpoint`](crate::Publisher::endpoint)). With several DP
    /// ranks the convention is base port + rank (or one path per rank).
    pub endpoint: String,
    /// Endpoint of the replay ROUTER socket; `None` publishes without replay and keeps no
    /// ring at all.
    pub replay_endpoint: Option<String>,
    /// Who may connect to the endpoints. Default: [`Access::default`] (ipc only, `0o600`).
    pub access: Access,
    /// Written as the batch's third element; a non-nil rank overrides the rank the router
    /// registered. Must fit in an i32 (the router decodes it as one). Default `None`.
    pub dp_rank: Option<u32>,
    /// Most events in one batch. Default [`DEFAULT_MAX_BATCH_EVENTS`].
    pub max_batch_events: usize,
    /// Longest an event waits for companions before its batch is sealed. `0` seals a
    /// batch as soon as the queue is momentarily empty. Default [`DEFAULT_FLUSH_INTERVAL`].
    pub flush_interval: Duration,
    /// Most batches kept for replay. Default [`DEFAULT_REPLAY_RING_LEN`].
    pub replay_ring_len: usize,
    /// Most payload bytes kept for replay; the oldest batches are evicted past it (a
    /// batch larger than this is published but not kept). Default
    /// [`DEFAULT_REPLAY_RING_BYTES`].
    pub replay_ring_bytes: u64,
    /// Events that may wait between the sinks and the publisher thread; beyond it sinks
    /// drop and count. Default [`DEFAULT_QUEUE_CAPACITY`].
    pub queue_capacity: usize,
    /// Bytes of events (their [`footprint`](crate::ValidEvent::footprint)) that may wait
    /// between the sinks and the publisher thread; beyond it sinks drop and count.
    /// Default [`DEFAULT_QUEUE_BYTES`].
    pub queue_bytes: u64,
    /// On shutdown, how long the sockets stay open after the last batch so subscribers
    /// can read it. Default [`DEFAULT_LINGER`].
    pub linger: Duration,
    /// The seq of the first batch: 0 for a new stream, or the predecessor's next seq when
    /// this publisher continues its stream (a takeover). A replay from below it is
    /// answered with a residency snapshot. Default 0.
    pub first_seq: u64,
}

impl PublisherConfig {
    /// A config binding `endpoint`, without replay, with every other field at its default.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            access: Access::default(),
            dp_rank: None,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            replay_ring_len: DEFAULT_REPLAY_RING_LEN,
            replay_ring_bytes: DEFAULT_REPLAY_RING_BYTES,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            linger: DEFAULT_LINGER,
            first_seq: 0,
        }
    }

    /// Continues a stream whose next batch is `seq` (a predecessor's [`EventSink::next_seq`]).
    ///
    /// [`EventSink::next_seq`]: crate::EventSink::next_seq
    #[must_use]
    pub fn continuing_at(mut self, seq: u64) -> Self {
        self.first_seq = seq;
        self
    }

    /// Sets the replay endpoint.
    #[must_use]
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Sets the DP rank written into every batch.
    #[must_use]
    pub fn with_dp_rank(mut self, rank: Option<u32>) -> Self {
        self.dp_rank = rank;
        self
    }

    /// Sets who may connect.
    #[must_use]
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Checks every field; [`Publisher::start`](crate::Publisher::start) calls this first.
    /// Returns the parsed endpoints (PUB, replay).
    pub fn validate(&self) -> Result<(Endpoint, Option<Endpoint>), PublisherError> {
        let bad = |field, problem: &str| PublisherError::InvalidConfig {
            field,
            problem: problem.to_owned(),
        };
        let endpoint = self.check_endpoint("endpoint", &self.endpoint)?;
        let replay = match &self.replay_endpoint {
            Some(r) => {
                let replay = self.check_endpoint("replay_endpoint", r)?;
                let wildcard = matches!(&replay, Endpoint::Tcp { port: 0, .. });
                if replay == endpoint && !wildcard {
                    return Err(bad(
                        "replay_endpoint",
                        "must differ from endpoint (or use port 0)",
                    ));
                }
                Some(replay)
            }
            None => None,
        };
        check_access(&self.access)?;
        if self.dp_rank.is_some_and(|r| i32::try_from(r).is_err()) {
            return Err(bad(
                "dp_rank",
                "must be at most i32::MAX (the router reads an i32)",
            ));
        }
        for (field, zero) in [
            ("max_batch_events", self.max_batch_events == 0),
            ("replay_ring_len", self.replay_ring_len == 0),
            ("replay_ring_bytes", self.replay_ring_bytes == 0),
            ("queue_capacity", self.queue_capacity == 0),
            ("queue_bytes", self.queue_bytes == 0),
        ] {
            if zero {
                return Err(bad(field, "must be at least 1"));
            }
        }
        Ok((endpoint, replay))
    }

    /// Parses one endpoint and applies the tcp rule.
    fn check_endpoint(&self, field: &'static str, s: &str) -> Result<Endpoint, PublisherError> {
        let e = Endpoint::parse(s).map_err(|e| PublisherError::InvalidConfig {
            field,
            problem: e.to_string(),
        })?;
        if !e.is_ipc() && !self.access.tcp_readable_by_anyone {
            return Err(PublisherError::InvalidConfig {
                field,
                problem: format!(
                    "{s} is a tcp:// endpoint: anyone who reaches the port (every local user \
                     included) reads every tenant's prompt token ids from it. Use ipc://PATH \
                     (a Unix socket with a mode and group), or say the network and every local \
                     user are trusted with tcp_readable_by_anyone"
                ),
            });
        }
        Ok(e)
    }
}

/// Modes may grant the owner and the group, never others.
fn check_access(a: &Access) -> Result<(), PublisherError> {
    let bad = |problem: String| PublisherError::InvalidConfig {
        field: "ipc_mode",
        problem,
    };
    if a.ipc_mode & !0o770 != 0 {
        return Err(bad(format!(
            "{:#o} grants others (or sets special bits): use 0o600, or 0o660 with ipc_group \
             set to the router's group",
            a.ipc_mode
        )));
    }
    if a.ipc_mode & 0o600 != 0o600 {
        return Err(bad(format!(
            "{:#o} denies the daemon's own user: include 0o600",
            a.ipc_mode
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(ep: &str) -> PublisherConfig {
        PublisherConfig::new(ep).with_access(Access {
            tcp_readable_by_anyone: true,
            ..Access::default()
        })
    }

    #[test]
    fn defaults_are_valid_small_and_private() {
        let c = PublisherConfig::new("ipc:///run/kvnode/events.sock");
        c.validate().unwrap();
        assert_eq!(c.replay_ring_len, 10_000);
        assert!(c.max_batch_events <= 64);
        assert_eq!(c.access.ipc_mode, 0o600);
        assert!(!c.access.tcp_readable_by_anyone);
        tcp("tcp://127.0.0.1:0").validate().unwrap();
    }

    #[test]
    fn tcp_without_the_switch_is_refused_with_the_fix() {
        let e = PublisherConfig::new("tcp://127.0.0.1:5557")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ipc://PATH") && e.contains("tcp_readable_by_anyone"),
            "{e}"
        );
        let e = PublisherConfig::new("ipc:///a/e.sock")
            .with_replay("tcp://h:1")
            .validate()
            .unwrap_err();
        assert!(matches!(
            e,
            PublisherError::InvalidConfig {
                field: "replay_endpoint",
                ..
            }
        ));
    }

    #[test]
    fn malformed_fields_are_named_in_the_error() {
        let mode = |m| Access {
            ipc_mode: m,
            ..Access::default()
        };
        let cases = [
            (tcp("udp://h:1"), "endpoint"),
            (tcp("tcp://h"), "endpoint"),
            (tcp("tcp://:5"), "endpoint"),
            (tcp("tcp://h:70000"), "endpoint"),
            (PublisherConfig::new("ipc://rel.sock"), "endpoint"),
            (tcp("tcp://h:1").with_replay("tcp://h:1"), "replay_endpoint"),
            (
                PublisherConfig::new("ipc:///a/e").with_replay("ipc:///a/e"),
                "replay_endpoint",
            ),
            (tcp("tcp://h:1").with_dp_rank(Some(u32::MAX)), "dp_rank"),
            (
                PublisherConfig::new("ipc:///a/e").with_access(mode(0o666)),
                "ipc_mode",
            ),
            (
                PublisherConfig::new("ipc:///a/e").with_access(mode(0o4600)),
                "ipc_mode",
            ),
            (
                PublisherConfig::new("ipc:///a/e").with_access(mode(0o060)),
                "ipc_mode",
            ),
            (
                PublisherConfig {
                    max_batch_events: 0,
                    ..tcp("tcp://h:1")
                },
                "max_batch_events",
            ),
            (
                PublisherConfig {
                    replay_ring_bytes: 0,
                    ..tcp("tcp://h:1")
                },
                "replay_ring_bytes",
            ),
            (
                PublisherConfig {
                    queue_bytes: 0,
                    ..tcp("tcp://h:1")
                },
                "queue_bytes",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, PublisherError::InvalidConfig { field: f, .. } if *f == field),
                "{field}: {err}"
            );
        }
    }
}
