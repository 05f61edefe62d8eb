//! `[events]`: where KV events are published, who may read them, and how much memory they
//! may hold. Every default documented; `deny_unknown_fields`.

use kvnode_events::PublisherConfig;
use kvnode_events::config::{
    Access, DEFAULT_IPC_MODE, DEFAULT_QUEUE_BYTES, DEFAULT_REPLAY_RING_BYTES,
    DEFAULT_REPLAY_RING_LEN,
};
use serde::{Deserialize, Serialize};

use crate::size_serde::{de_size, ser_size};

/// KV events to the router (`[events]`); off while `endpoint` is unset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsSettings {
    /// `ipc:///PATH` (or, with `tcp_readable_by_anyone`, `tcp://HOST:PORT`) the ZMQ PUB
    /// socket binds (`--events`). Default: none (no events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Endpoint of the replay ROUTER socket (`--events-replay`). Default: none, and then no
    /// replay ring is kept at all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// Data-parallel rank written into every batch (`--dp-rank`). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// Mode of the `ipc://` socket files (`--events-socket-mode`): owner and group bits
    /// only; a reading group needs `0o660`. Default: `0o600` (the daemon's user only).
    pub socket_mode: u32,
    /// Group (gid) of the `ipc://` socket files (`--events-socket-group`): the router's,
    /// with `socket_mode = 0o660`. The daemon must be root or a member. Default: none (the
    /// daemon's group).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_group: Option<u32>,
    /// Allow `tcp://` endpoints (`--events-tcp-readable-by-anyone`). Anyone who reaches the
    /// port, every local user included, then reads every published block's prompt token
    /// ids and tenant salt: set it only where the network and every local user are
    /// trusted with all tenants' prompts. Default: false (tcp refused at start).
    pub tcp_readable_by_anyone: bool,
    /// Most payload bytes kept for replay (`--events-replay-bytes`). Default: 64 MiB.
    #[serde(serialize_with = "ser_size", deserialize_with = "de_size")]
    pub replay_ring_bytes: u64,
    /// Most batches kept for replay (`--events-replay-len`). A subscriber asking for an
    /// older seq gets a residency snapshot instead. Default: 10 000.
    pub replay_ring_len: usize,
    /// Most bytes of events waiting for the publisher thread; past it events are dropped
    /// and counted. Default: 64 MiB.
    #[serde(serialize_with = "ser_size", deserialize_with = "de_size")]
    pub queue_bytes: u64,
}

impl Default for EventsSettings {
    fn default() -> Self {
        Self {
            endpoint: None,
            replay: None,
            dp_rank: None,
            socket_mode: DEFAULT_IPC_MODE,
            socket_group: None,
            tcp_readable_by_anyone: false,
            replay_ring_bytes: DEFAULT_REPLAY_RING_BYTES,
            replay_ring_len: DEFAULT_REPLAY_RING_LEN,
            queue_bytes: DEFAULT_QUEUE_BYTES,
        }
    }
}

impl EventsSettings {
    /// The publisher's config, when events are on.
    pub fn publisher_config(&self) -> Option<PublisherConfig> {
        let ep = self.endpoint.as_ref()?;
        let mut pc = PublisherConfig::new(ep.clone())
            .with_dp_rank(self.dp_rank)
            .with_access(Access {
                ipc_mode: self.socket_mode,
                ipc_group: self.socket_group,
                tcp_readable_by_anyone: self.tcp_readable_by_anyone,
            });
        if let Some(r) = &self.replay {
            pc = pc.with_replay(r.clone());
        }
        pc.replay_ring_bytes = self.replay_ring_bytes;
        pc.replay_ring_len = self.replay_ring_len;
        pc.queue_bytes = self.queue_bytes;
        Some(pc)
    }

    /// Checks what the publisher would refuse, before anything binds.
    pub fn validate(&self) -> Result<(), String> {
        if self.replay.is_some() && self.endpoint.is_none() {
            return Err("[events] replay (--events-replay) needs an endpoint (--events)".into());
        }
        match self.publisher_config() {
            Some(pc) => pc.validate().map(drop).map_err(|e| {
                format!(
                    "{e} ([events] socket_mode / socket_group / tcp_readable_by_anyone; flags \
                     --events-socket-mode, --events-socket-group, --events-tcp-readable-by-anyone)"
                )
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str) -> Result<EventsSettings, String> {
        let s: EventsSettings = toml::from_str(text).map_err(|e| e.to_string())?;
        s.validate()?;
        Ok(s)
    }

    #[test]
    fn a_documented_section_parses_with_its_defaults() {
        let s = parse(
            "endpoint = \"ipc:///run/kvnode/events.sock\"\n\
             replay = \"ipc:///run/kvnode/events-replay.sock\"\n\
             socket_mode = 0o660\nsocket_group = 990\nreplay_ring_bytes = \"8MiB\"\n",
        )
        .unwrap();
        assert_eq!((s.socket_mode, s.socket_group), (0o660, Some(990)));
        assert_eq!(s.replay_ring_bytes, 8 << 20);
        assert_eq!(s.queue_bytes, 64 << 20);
        assert_eq!(s.publisher_config().unwrap().replay_ring_len, 10_000);
        let d = parse("").unwrap();
        assert_eq!((d.socket_mode, d.tcp_readable_by_anyone), (0o600, false));
        let small = parse("endpoint = \"ipc:///e\"\nreplay = \"ipc:///r\"\nreplay_ring_len = 16\n");
        assert_eq!(
            small.unwrap().publisher_config().unwrap().replay_ring_len,
            16
        );
        let zero = parse("endpoint = \"ipc:///e\"\nreplay = \"ipc:///r\"\nreplay_ring_len = 0\n");
        assert!(zero.unwrap_err().contains("replay_ring_len"));
    }

    #[test]
    fn unsafe_or_malformed_sections_are_refused_with_what_to_change() {
        for (text, says) in [
            (
                "endpoint = \"tcp://0.0.0.0:5557\"\n",
                "tcp_readable_by_anyone",
            ),
            (
                "endpoint = \"ipc:///e\"\nsocket_mode = 0o666\n",
                "grants others",
            ),
            ("endpoint = \"ipc://rel\"\n", "ABSOLUTE"),
            ("replay = \"ipc:///r\"\n", "needs an endpoint"),
            (
                "endpoint = \"ipc:///e\"\nreplay_ring_bytes = 0\n",
                "replay_ring_bytes",
            ),
            (
                "endpoint = \"ipc:///e\"\nsocket_modes = 1\n",
                "unknown field",
            ),
            ("replay_ring_bytes = \"lots\"\n", ""),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        let tcp = parse("endpoint = \"tcp://127.0.0.1:5557\"\ntcp_readable_by_anyone = true\n");
        assert!(tcp.is_ok(), "{tcp:?}");
    }

    proptest! {
        #[test]
        fn any_section_parses_or_is_refused_without_panicking(
            mode in 0u32..0o10000,
            group in proptest::option::of(any::<u32>()),
            tcp in any::<bool>(),
            ep in "(ipc|tcp)://[a-z0-9/:.]{0,20}",
            bytes in 0u64..(1 << 40),
        ) {
            let group = group.map(|g| format!("socket_group = {g}\n")).unwrap_or_default();
            let text = format!(
                "endpoint = \"{ep}\"\nsocket_mode = {mode}\n{group}tcp_readable_by_anyone = {tcp}\nqueue_bytes = {bytes}\n"
            );
            if let Ok(s) = parse(&text) {
                prop_assert_eq!(s.socket_mode & !0o770, 0);
                prop_assert!(s.queue_bytes > 0);
                prop_assert!(tcp || ep.starts_with("ipc://"));
                let back: EventsSettings = toml::from_str(&toml::to_string(&s).unwrap()).unwrap();
                prop_assert_eq!(back, s);
            }
        }
    }
}
