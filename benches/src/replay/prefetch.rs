//! `--prefetch-at placement`: the router starts the hinted pull when it places a request, with
//! an `Act` carrying a `kv.prefetch` of the hint's source and hashes to the destination node's
//! daemon (docs/client-protocol.md, "Router actions (Act)"). The engine's hinted get, when it
//! schedules the request, then joins the pull in flight or finds the blocks local.

use std::path::Path;

use anyhow::Context;
use kvnode_client::Client;
use kvnode_proto::Key;
use kvnode_proto::actions::ActionOutcome;

use super::blocks;
use super::engine::{Hint, spec};

/// The envelope of one `kv.prefetch` of `hashes` from `endpoint`.
pub fn envelope(endpoint: &str, hashes: &[u64], id: u64) -> String {
    serde_json::json!({
        "protocol_version": "1.0",
        "message_id": format!("replay-{id}"),
        "actions": [{
            "action_id": "p0",
            "action_type": "kv.prefetch",
            "action_version": "1.0",
            "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes},
        }],
    })
    .to_string()
}

/// The router's connections to every daemon, for its actions.
#[derive(Debug)]
pub struct Prefetcher {
    conns: Vec<(Client, u32)>,
    sent: u64,
    /// Prefetches a daemon started (outcome `Pulling`).
    pub started: u64,
    /// Prefetches answered otherwise (refused, or nothing to do).
    pub other: u64,
    /// The first such answer.
    pub first_other: Option<String>,
}

impl Prefetcher {
    /// Connects to the daemons at `socks` and registers the replay's namespace on each.
    pub fn connect<'a>(socks: impl Iterator<Item = &'a Path>, block: u64) -> anyhow::Result<Self> {
        let conns = socks
            .map(|s| -> anyhow::Result<(Client, u32)> {
                let mut c = Client::connect(s).context("router connecting to a daemon")?;
                let ns = c.register(&spec(block))?.ns;
                Ok((c, ns))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            conns,
            sent: 0,
            started: 0,
            other: 0,
            first_other: None,
        })
    }

    /// Sends cache `dest`'s daemon a `kv.prefetch` of the blocks `hint` covers; returns whether
    /// it started a pull.
    pub fn start(&mut self, dest: usize, blocks: &[u64], hint: &Hint) -> anyhow::Result<bool> {
        let covered = &blocks[..hint.blocks.min(blocks.len())];
        let keys: Vec<Key> = covered.iter().map(|&b| blocks::key(b)).collect();
        self.sent += 1;
        let (c, ns) = &mut self.conns[dest];
        let (_, results) = c
            .act(*ns, &keys, &envelope(&hint.endpoint, covered, self.sent))
            .context("kv.prefetch at placement")?;
        let started = matches!(
            results.first().map(|r| &r.outcome),
            Some(ActionOutcome::Pulling(_))
        );
        if started {
            self.started += 1;
        } else {
            self.other += 1;
            if self.first_other.is_none() {
                self.first_other = Some(format!("{results:?}"));
            }
        }
        Ok(started)
    }
}

impl std::fmt::Display for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "router: {} kv.prefetch sent at placement, {} started a pull, {} answered otherwise",
            self.sent, self.started, self.other
        )?;
        if let Some(o) = &self.first_other {
            write!(f, " (first: {o})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvnode_proto::actions::{Action, parse_envelope};

    #[test]
    fn the_envelope_parses_as_a_prefetch_from_the_source() {
        let e = envelope("tcp://127.0.0.1:7001", &[5, 6, 7], 1);
        let Ok(env) = parse_envelope(&e) else {
            panic!("{e}")
        };
        let Ok(Action::Prefetch {
            source,
            block_hashes,
        }) = &env.actions[0].action
        else {
            panic!("{env:?}")
        };
        assert!(source.is_some());
        assert_eq!(block_hashes, &[5, 6, 7]);
    }
}
