//! `--prefetch-at placement`: the router starts the hinted pull when it places a request, with
//! a signed `POST /v1/act` to the destination node's router entry (docs/router-entry.md)
//! carrying one `kv.prefetch` of the hint's source and router hashes, for the replay's model.
//! The destination resolves the hashes it did not announce itself at the source (peer
//! `Resolve`) and pulls; the engine's hinted get, when it schedules the request, then joins
//! the pull in flight or finds the blocks local.

use kvnode_client::router::{RouterEntry, RouterEntryError};
use kvnode_proto::actions::ActionOutcome;
use kvnode_proto::router::RouterRequest;

use super::engine::{Hint, spec};

/// The envelope of one `kv.prefetch` of `hashes` (router hashes: a replay block's id is its
/// key's router hash) from `endpoint`.
pub fn envelope(endpoint: &str, hashes: &[u64], id: u64) -> serde_json::Value {
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
}

/// The router's side: every daemon's router entry, and what the prefetches did.
#[derive(Debug)]
pub struct Prefetcher {
    entries: Vec<RouterEntry>,
    model: String,
    sent: u64,
    /// Prefetches a daemon started (outcome `Pulling`).
    pub started: u64,
    /// Prefetches the entry refused (any status but 200).
    pub refused: u64,
    /// Prefetches run with another outcome (nothing to pull, or the action refused).
    pub other: u64,
    /// The first refusal or other outcome.
    pub first_other: Option<String>,
}

impl Prefetcher {
    /// The router of a fleet whose router entries are `entries` (one per cache), for the
    /// replay's namespace (blocks of `block` bytes).
    pub fn new(entries: Vec<RouterEntry>, block: u64) -> Self {
        Self {
            entries,
            model: spec(block).model,
            sent: 0,
            started: 0,
            refused: 0,
            other: 0,
            first_other: None,
        }
    }

    /// Sends cache `dest`'s router entry a `kv.prefetch` of the blocks `hint` covers; returns
    /// whether it started a pull. A refusal is counted, not an error (the engine's hinted get
    /// still pulls); only I/O with the entry fails the run.
    pub fn start(&mut self, dest: usize, blocks: &[u64], hint: &Hint) -> anyhow::Result<bool> {
        let covered = &blocks[..hint.blocks.min(blocks.len())];
        self.sent += 1;
        let req = RouterRequest {
            model: self.model.clone(),
            namespace: None,
            hints: envelope(&hint.endpoint, covered, self.sent),
        };
        let note = match self.entries[dest].act(&req) {
            Ok(reply) => {
                let first = reply.namespaces.first().and_then(|n| n.results.first());
                if matches!(first.map(|r| &r.outcome), Some(ActionOutcome::Pulling(_))) {
                    self.started += 1;
                    return Ok(true);
                }
                self.other += 1;
                format!("{reply:?}")
            }
            Err(e @ RouterEntryError::Refused { .. }) => {
                self.refused += 1;
                e.to_string()
            }
            Err(e) => return Err(anyhow::Error::new(e).context("kv.prefetch at placement")),
        };
        self.first_other.get_or_insert(note);
        Ok(false)
    }
}

impl std::fmt::Display for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "router: {} kv.prefetch sent at placement to the router entries, {} started a pull, {} refused by the entry, {} answered otherwise",
            self.sent, self.started, self.refused, self.other
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
        let e = envelope("tcp://127.0.0.1:7001", &[5, 6, 7], 1).to_string();
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
