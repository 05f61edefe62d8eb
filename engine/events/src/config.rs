//! Publisher configuration, every default documented.

use std::time::Duration;

use crate::error::PublisherError;

/// Default for [`PublisherConfig::max_batch_events`]: small, so one bad batch (the router
/// drops a batch whole) could hide at most this many events.
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 64;
/// Default for [`PublisherConfig::flush_interval`].
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(2);
/// Default for [`PublisherConfig::replay_ring_len`] (`SGLang` keeps the same number).
pub const DEFAULT_REPLAY_RING_LEN: usize = 10_000;
/// Default for [`PublisherConfig::queue_capacity`].
pub const DEFAULT_QUEUE_CAPACITY: usize = 65_536;
/// Default for [`PublisherConfig::linger`].
pub const DEFAULT_LINGER: Duration = Duration::from_millis(100);

/// How a [`Publisher`](crate::Publisher) binds and batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// `tcp://HOST:PORT` the PUB socket binds (port 0 picks a free port; see
    /// [`Publisher::endpoint`](crate::Publisher::endpoint)). With several DP ranks the
    /// convention is base port + rank.
    pub endpoint: String,
    /// `tcp://HOST:PORT` for the replay ROUTER socket; `None` publishes without replay.
    pub replay_endpoint: Option<String>,
    /// Written as the batch's third element; a non-nil rank overrides the rank the router
    /// registered. Must fit in an i32 (the router decodes it as one). Default `None`.
    pub dp_rank: Option<u32>,
    /// Most events in one batch. Default [`DEFAULT_MAX_BATCH_EVENTS`].
    pub max_batch_events: usize,
    /// Longest an event waits for companions before its batch is sealed. `0` seals a
    /// batch as soon as the queue is momentarily empty. Default [`DEFAULT_FLUSH_INTERVAL`].
    pub flush_interval: Duration,
    /// Recent batches kept for replay. Default [`DEFAULT_REPLAY_RING_LEN`].
    pub replay_ring_len: usize,
    /// Events that may wait between the sinks and the publisher thread; beyond it sinks
    /// drop and count. Default [`DEFAULT_QUEUE_CAPACITY`].
    pub queue_capacity: usize,
    /// On shutdown, how long the sockets stay open after the last batch so subscribers
    /// can read it. Default [`DEFAULT_LINGER`].
    pub linger: Duration,
}

impl PublisherConfig {
    /// A config binding `endpoint`, without replay, with every other field at its default.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            dp_rank: None,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            replay_ring_len: DEFAULT_REPLAY_RING_LEN,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            linger: DEFAULT_LINGER,
        }
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

    /// Checks every field; [`Publisher::start`](crate::Publisher::start) calls this first.
    pub fn validate(&self) -> Result<(), PublisherError> {
        let bad = |field, problem: &str| PublisherError::InvalidConfig {
            field,
            problem: problem.to_owned(),
        };
        check_endpoint("endpoint", &self.endpoint)?;
        if let Some(replay) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", replay)?;
            if replay == &self.endpoint && !replay.ends_with(":0") {
                return Err(bad(
                    "replay_endpoint",
                    "must differ from endpoint (or use port 0)",
                ));
            }
        }
        if self.dp_rank.is_some_and(|r| i32::try_from(r).is_err()) {
            return Err(bad(
                "dp_rank",
                "must be at most i32::MAX (the router reads an i32)",
            ));
        }
        if self.max_batch_events == 0 {
            return Err(bad("max_batch_events", "must be at least 1"));
        }
        if self.replay_ring_len == 0 {
            return Err(bad("replay_ring_len", "must be at least 1"));
        }
        if self.queue_capacity == 0 {
            return Err(bad("queue_capacity", "must be at least 1"));
        }
        Ok(())
    }
}

/// Accepts `tcp://HOST:PORT` with a non-empty host and a port in 0..=65535.
fn check_endpoint(field: &'static str, endpoint: &str) -> Result<(), PublisherError> {
    let problem = |p: &str| PublisherError::InvalidConfig {
        field,
        problem: format!("{endpoint:?} {p}; use tcp://HOST:PORT"),
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| problem("is not a tcp:// endpoint"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| problem("has no port"))?;
    if host.is_empty() {
        return Err(problem("has no host"));
    }
    port.parse::<u16>()
        .map_err(|_| problem("has a port outside 0..=65535"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_small() {
        let c = PublisherConfig::new("tcp://127.0.0.1:0");
        c.validate().unwrap();
        assert_eq!(c.replay_ring_len, 10_000);
        assert!(c.max_batch_events <= 64);
    }

    #[test]
    fn malformed_fields_are_named_in_the_error() {
        let cases = [
            (PublisherConfig::new("udp://h:1"), "endpoint"),
            (PublisherConfig::new("tcp://h"), "endpoint"),
            (PublisherConfig::new("tcp://:5"), "endpoint"),
            (PublisherConfig::new("tcp://h:70000"), "endpoint"),
            (
                PublisherConfig::new("tcp://h:1").with_replay("tcp://h:1"),
                "replay_endpoint",
            ),
            (
                PublisherConfig::new("tcp://h:1").with_dp_rank(Some(u32::MAX)),
                "dp_rank",
            ),
            (
                PublisherConfig {
                    max_batch_events: 0,
                    ..PublisherConfig::new("tcp://h:1")
                },
                "max_batch_events",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, PublisherError::InvalidConfig { field: f, .. } if *f == field),
                "{err}"
            );
        }
    }
}
