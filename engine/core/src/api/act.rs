//! `Act`: a router's hints envelope executed for one request's keys, one result per action.
//!
//! An action names blocks by router hash; it applies to the request's keys whose page has one
//! of those hashes (every segment of the page). Parsing is `kvnode_proto::actions`; what each
//! action does to the tiers is the store's (store/intent.rs, store/demote.rs); pulls go
//! through the peer path as a hinted `Exists` does (same authorization, quotas and op table).

use std::collections::HashSet;
use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::actions::{Action, ActionOutcome, ActionResult, Parsed, Refusal, parse_envelope};
use kvnode_proto::client::{ErrorCode, Reply};
use kvnode_proto::hint::{Endpoint, HintError};

use super::errors::{error, tier_error};
use super::session::Session;
use crate::dram::TierError;
use crate::engine::Engine;
use crate::peer::PullRequest;

use super::hinted::background_pull;

/// The request's keys an action names, and how many of its hashes named none of them.
fn named(keys: &[Key], hashes: &[u64]) -> (Vec<Key>, u32) {
    let want: HashSet<u64> = hashes.iter().copied().collect();
    let picked: Vec<Key> = keys
        .iter()
        .filter(|k| want.contains(&k.0.router_hash()))
        .copied()
        .collect();
    let seen: HashSet<u64> = picked.iter().map(|k| k.0.router_hash()).collect();
    (picked, (want.len() - seen.len()) as u32)
}

fn done(blocks: u32, skipped: u32, note: &str) -> ActionOutcome {
    ActionOutcome::Done {
        blocks,
        skipped,
        note: if skipped > 0 {
            note.to_owned()
        } else {
            String::new()
        },
    }
}

fn refused(e: &TierError) -> ActionOutcome {
    let code = match e {
        TierError::UnknownNamespace(_) => Refusal::UnknownNamespace,
        TierError::NoLowerTier => Refusal::Unsupported,
        _ => Refusal::Invalid,
    };
    ActionOutcome::Refused {
        code,
        message: e.to_string(),
    }
}

/// The compact `kv.fetch` form of a pull from `source` (the peer path parses and authorizes
/// it exactly as a router's own `kv.fetch`).
fn fetch_hint(source: &Endpoint, hashes: &[u64]) -> String {
    serde_json::json!({
        "source_control_endpoint": source.to_string(),
        "block_hashes": hashes,
    })
    .to_string()
}

impl Session {
    /// `Act`: every action of the envelope, in order.
    pub(super) async fn act(&mut self, ns: u32, keys: &[Key], hints: &str) -> Reply {
        if let Err(e) = self.engine.store.namespace_id(ns) {
            return tier_error(&e);
        }
        let env = match parse_envelope(hints) {
            Ok(e) => e,
            Err(e) => return error(ErrorCode::Invalid, format!("hints envelope refused: {e}")),
        };
        let mut results = Vec::with_capacity(env.actions.len());
        for p in env.actions {
            results.push(self.execute(ns, keys, p).await);
        }
        Reply::Acted {
            message_id: env.message_id,
            results,
        }
    }

    /// The actions of a hinted request's envelope besides the `kv.fetch` its pull follows
    /// (the first one), executed as `Act` executes them; reported in the pull's report. A
    /// hint that is not an envelope (the compact form, or one the pull refuses) has none.
    pub(super) async fn side_actions(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
    ) -> Vec<ActionResult> {
        let Some(Ok(env)) = hint.map(parse_envelope) else {
            return Vec::new();
        };
        let mut followed = false;
        let mut out = Vec::new();
        for p in env.actions {
            // The first kv.fetch is the pull's own (its refusal, if any, is the op's reason).
            if p.action_type == "kv.fetch" && !std::mem::replace(&mut followed, true) {
                continue;
            }
            out.push(self.execute(ns, keys, p).await);
        }
        out
    }

    /// One parsed action, executed for this connection.
    async fn execute(&mut self, ns: u32, keys: &[Key], p: Parsed) -> ActionResult {
        Actor {
            engine: &self.engine,
            conn: self.id,
        }
        .execute(ns, keys, p)
        .await
    }
}

/// Who executes actions: the engine, on behalf of connection `conn` (a client's session,
/// or the router entry's own), which owns the pulls they start.
pub(crate) struct Actor<'a> {
    /// The engine.
    pub engine: &'a Arc<Engine>,
    /// The connection the pulls belong to.
    pub conn: u64,
}

impl Actor<'_> {
    /// One parsed action, executed (or refused) and reported.
    pub async fn execute(&self, ns: u32, keys: &[Key], p: Parsed) -> ActionResult {
        let outcome = match p.action {
            Ok(a) => self.run_action(ns, keys, a).await,
            Err(e) => ActionOutcome::Refused {
                code: match e {
                    HintError::UnknownAction(_) | HintError::ActionVersion(_) => {
                        Refusal::Unsupported
                    }
                    _ => Refusal::Invalid,
                },
                message: format!(
                    "action {:?} ({:?}) refused: {e}",
                    p.action_id, p.action_type
                ),
            },
        };
        tracing::debug!(conn = self.conn, action = %p.action_type, id = %p.action_id, ?outcome, "router action");
        ActionResult {
            action_id: p.action_id,
            action_type: p.action_type,
            outcome,
        }
    }

    async fn run_action(&self, ns: u32, keys: &[Key], a: Action) -> ActionOutcome {
        let store = Arc::clone(&self.engine.store);
        let (picked, unmatched) = named(keys, a.block_hashes());
        let r = match a {
            Action::Fetch(f) => return self.prefetch(ns, keys, Some(&f.endpoint), &f.block_hashes).await,
            Action::Prefetch {
                source,
                block_hashes,
            } => return self.prefetch(ns, keys, source.as_ref(), &block_hashes).await,
            Action::Retain { ttl, .. } => store.retain(ns, &picked, ttl).map(|o| {
                let skipped = unmatched + o.absent + o.over_quota;
                let note = format!(
                    "{} named hashes match no key of the request, {} keys are not in DRAM, {} keys are over the tenant's retained quota",
                    unmatched, o.absent, o.over_quota
                );
                done(o.held, skipped, &note)
            }),
            Action::Release { .. } => store.release_retention(ns, &picked).map(|n| {
                let skipped = picked.len() as u32 - n + unmatched;
                done(n, skipped, "keys not held (not retained, or not in DRAM)")
            }),
            Action::Demote { .. } => store.demote_now(ns, &picked).await.map(|o| {
                let note = format!(
                    "{} hashes match no key, {} keys not in DRAM or in use, {} without room in the tenant's NVMe quota (dropped), {} writes failed (kept in DRAM)",
                    unmatched, o.skipped, o.refused, o.failed
                );
                done(o.moved, unmatched + o.skipped + o.refused + o.failed, &note)
            }),
            Action::Evict { .. } => store.evict(ns, &picked).map(|n| {
                let skipped = picked.len() as u32 - n + unmatched;
                done(n, skipped, "keys held by no tier of this node")
            }),
        };
        r.unwrap_or_else(|e| refused(&e))
    }

    /// `kv.prefetch` / `kv.fetch`: promotes what this node's NVMe holds, and pulls the rest of
    /// the covered prefix from `source` in the background (an op to `Wait` for).
    async fn prefetch(
        &self,
        ns: u32,
        keys: &[Key],
        source: Option<&Endpoint>,
        hashes: &[u64],
    ) -> ActionOutcome {
        let (picked, unmatched) = named(keys, hashes);
        let promoting = match self.engine.store.promote_in_background(ns, &picked) {
            Ok((n, _task)) => n,
            Err(e) => return refused(&e),
        };
        let Some(source) = source else {
            return ActionOutcome::Started {
                blocks: promoting,
                skipped: picked.len() as u32 - promoting + unmatched,
            };
        };
        let hint = fetch_hint(source, hashes);
        let req = PullRequest {
            conn: self.conn,
            ns,
            keys,
            hint: &hint,
            into: Vec::new(),
            deadline_ms: None,
            hand_leases: false,
            actions: Vec::new(),
        };
        ActionOutcome::Pulling(Box::new(background_pull(&self.engine.peers, req).await))
    }
}
