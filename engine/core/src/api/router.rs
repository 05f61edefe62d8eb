//! The router entry's work (docs/router-entry.md): checks a signed request ([`RouterGate`]),
//! picks the namespaces of its model, names its blocks by router hash and runs its actions
//! exactly as a client's `Act` runs them ([`Actor`]).
//!
//! A router knows blocks by the hashes of the KV events, not by their keys. The keys come
//! from what this node announced under those hashes (`Announcer::resolve`) and, for a pull,
//! from what the source announced (`Peers::resolve`, the peer protocol's `Resolve`). So a
//! router can name only blocks it could have learned from the events.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};

use kvnode_proto::actions::{Action, ActionOutcome, ActionResult, Parsed, Refusal, parse_envelope};
use kvnode_proto::router::{
    MAX_SKEW_MS, NamespaceActed, RouterReply, RouterRequest, key_id, signature_ok,
};
use kvnode_proto::{Digest, Key, NamespaceId, NamespaceSpec};

use super::act::Actor;
use crate::engine::Engine;

/// Signatures remembered (each until its timestamp leaves the window): at most this many
/// requests per window are accepted; more are refused as busy.
const MAX_SEEN: usize = 1 << 16;

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterRefused {
    /// A signing header is absent.
    #[error("header {0} is missing: requests must be signed (docs/router-entry.md)")]
    Missing(&'static str),
    /// This daemon holds no cluster key (it never accepts a request then).
    #[error("this daemon has no cluster key: the router entry accepts nothing")]
    NoKey,
    /// The key id names no key of this daemon's cluster key file.
    #[error("key id {0:?} names no cluster key of this daemon")]
    UnknownKey(String),
    /// The timestamp is not a decimal number of milliseconds.
    #[error("timestamp {0:?} is not Unix milliseconds")]
    BadTimestamp(String),
    /// The timestamp is too far from this daemon's clock.
    #[error("timestamp is {skew_ms} ms from this daemon's clock (at most {MAX_SKEW_MS})")]
    Stale {
        /// The difference.
        skew_ms: u64,
    },
    /// The signature does not match.
    #[error("signature does not match the request")]
    BadSignature,
    /// The same signed request was accepted before.
    #[error("this signed request was already accepted (replay)")]
    Replayed,
    /// Too many requests within the replay window.
    #[error("too many requests within {MAX_SKEW_MS} ms; retry later")]
    Busy,
    /// The body is not a router request.
    #[error("request refused: {0}")]
    Invalid(String),
    /// No namespace of the model is registered here.
    #[error("no namespace of model {0:?} is registered on this node")]
    NoNamespace(String),
}

impl RouterRefused {
    /// Whether the caller failed authentication (as opposed to sending a bad request).
    pub fn is_auth(&self) -> bool {
        !matches!(self, Self::Invalid(_) | Self::NoNamespace(_) | Self::Busy)
    }
}

/// The signing headers of one request, as received.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    /// `x-kvnode-key-id`.
    pub key_id: Option<&'a str>,
    /// `x-kvnode-timestamp`.
    pub timestamp: Option<&'a str>,
    /// `x-kvnode-signature`.
    pub signature: Option<&'a str>,
}

/// Checks requests and runs them; one per router entry.
#[derive(Debug)]
pub struct RouterGate {
    engine: Arc<Engine>,
    /// The connection the entry's pulls belong to.
    conn: u64,
    /// Accepted signatures and the time (ms) after which they can no longer be replayed.
    seen: Mutex<HashMap<String, u64>>,
}

impl RouterGate {
    /// A gate for `engine`, whose counters `engine.stats()` reports.
    pub fn new(engine: &Arc<Engine>) -> Arc<Self> {
        engine.router.serving.store(true, Relaxed);
        Arc::new(Self {
            engine: Arc::clone(engine),
            conn: engine.internal_conn(),
            seen: Mutex::default(),
        })
    }

    /// Authenticates and runs one request: `POST path` with `body`, at `now_ms`.
    pub async fn handle(
        &self,
        h: Signed<'_>,
        path: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<RouterReply, RouterRefused> {
        let r = match self.check(h, path, body, now_ms) {
            Ok(()) => self.run(body).await,
            Err(e) => Err(e),
        };
        let c = &self.engine.router;
        let counter = match &r {
            Ok(_) => &c.accepted,
            Err(RouterRefused::Replayed | RouterRefused::Stale { .. } | RouterRefused::Busy) => {
                &c.refused_replay
            }
            Err(e) if e.is_auth() => &c.refused_auth,
            Err(_) => &c.refused_invalid,
        };
        counter.fetch_add(1, Relaxed);
        r
    }

    /// Signature, clock and replay checks; nothing of the body is read before they pass.
    fn check(
        &self,
        h: Signed<'_>,
        path: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), RouterRefused> {
        use kvnode_proto::router::{HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP};
        let id = h.key_id.ok_or(RouterRefused::Missing(HEADER_KEY_ID))?;
        let ts = h
            .timestamp
            .ok_or(RouterRefused::Missing(HEADER_TIMESTAMP))?;
        let sig = h
            .signature
            .ok_or(RouterRefused::Missing(HEADER_SIGNATURE))?;
        let ring = self.engine.peers.keys().ok_or(RouterRefused::NoKey)?;
        let key = ring
            .keys()
            .iter()
            .map(crate::peer::auth::ClusterKey::router_key)
            .find(|k| key_id(k) == id)
            .ok_or_else(|| RouterRefused::UnknownKey(id.chars().take(32).collect()))?;
        let ts_ms: u64 = ts
            .parse()
            .map_err(|_| RouterRefused::BadTimestamp(ts.chars().take(32).collect()))?;
        if !signature_ok(&key, sig, ts_ms, "POST", path, body) {
            return Err(RouterRefused::BadSignature);
        }
        let skew_ms = now_ms.abs_diff(ts_ms);
        if skew_ms > MAX_SKEW_MS {
            return Err(RouterRefused::Stale { skew_ms });
        }
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.len() >= MAX_SEEN {
            seen.retain(|_, until| *until >= now_ms);
        }
        if seen.contains_key(sig) {
            return Err(RouterRefused::Replayed);
        }
        if seen.len() >= MAX_SEEN {
            return Err(RouterRefused::Busy);
        }
        seen.insert(sig.to_owned(), ts_ms + MAX_SKEW_MS);
        Ok(())
    }

    /// Runs an authenticated request's actions in every namespace it names.
    async fn run(&self, body: &[u8]) -> Result<RouterReply, RouterRefused> {
        let req: RouterRequest =
            serde_json::from_slice(body).map_err(|e| RouterRefused::Invalid(e.to_string()))?;
        let env = parse_envelope(&req.hints_text())
            .map_err(|e| RouterRefused::Invalid(format!("hints envelope refused: {e}")))?;
        let targets = self.namespaces(&req);
        if targets.is_empty() {
            return Err(RouterRefused::NoNamespace(
                req.model.chars().take(128).collect(),
            ));
        }
        let mut namespaces = Vec::with_capacity(targets.len());
        for (h, id, spec) in targets {
            let mut results = Vec::with_capacity(env.actions.len());
            for p in &env.actions {
                results.push(self.execute(h, id, &spec, p.clone()).await);
            }
            namespaces.push(NamespaceActed {
                namespace: id.to_string(),
                tp_rank: spec.tp_rank,
                results,
            });
        }
        Ok(RouterReply {
            message_id: env.message_id,
            namespaces,
        })
    }

    /// The registered namespaces the request names.
    fn namespaces(&self, req: &RouterRequest) -> Vec<(u32, NamespaceId, NamespaceSpec)> {
        self.engine
            .store
            .dram()
            .namespaces()
            .into_iter()
            .filter(|(_, id, spec)| {
                spec.model == req.model
                    && req.namespace.as_ref().is_none_or(|n| *n == id.to_string())
            })
            .collect()
    }

    /// One action in one namespace: its blocks named by key, then run as `Act` runs it.
    async fn execute(
        &self,
        h: u32,
        id: NamespaceId,
        spec: &NamespaceSpec,
        p: Parsed,
    ) -> ActionResult {
        let keys = match &p.action {
            Ok(a) => match self.keys_of(id, spec, a).await {
                Ok(k) => k,
                Err(message) => {
                    return ActionResult {
                        action_id: p.action_id,
                        action_type: p.action_type,
                        outcome: ActionOutcome::Refused {
                            code: Refusal::SourceFailed,
                            message,
                        },
                    };
                }
            },
            Err(_) => Vec::new(),
        };
        let actor = Actor {
            engine: &self.engine,
            conn: self.conn,
        };
        actor.execute(h, &keys, p).await
    }

    /// The keys (every segment) of the pages the action's hashes name: those this node
    /// announced, and for a pull those the source announced, in the hashes' order.
    async fn keys_of(
        &self,
        id: NamespaceId,
        spec: &NamespaceSpec,
        a: &Action,
    ) -> Result<Vec<Key>, String> {
        let hashes = a.block_hashes();
        let mut digests = self.engine.store.announcer().resolve(id, hashes);
        let source = match a {
            Action::Fetch(f) => Some(&f.endpoint),
            Action::Prefetch { source, .. } => source.as_ref(),
            _ => None,
        };
        if let Some(src) = source
            && digests.iter().any(Option::is_none)
        {
            let remote = self
                .engine
                .peers
                .resolve(src, id, hashes)
                .await
                .map_err(|f| {
                    format!(
                        "resolving {} hashes at {src}: {:?}: {}",
                        hashes.len(),
                        f.code,
                        f.message
                    )
                })?;
            for (d, r) in digests.iter_mut().zip(remote) {
                *d = d.or(r);
            }
        }
        Ok(page_keys(&digests, spec))
    }
}

/// Every segment's key of each resolved page, in order.
fn page_keys(digests: &[Option<Digest>], spec: &NamespaceSpec) -> Vec<Key> {
    let segments = u16::try_from(spec.segments.len()).unwrap_or(u16::MAX);
    digests
        .iter()
        .flatten()
        .flat_map(|d| (0..segments).map(move |s| Key(*d, s)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_give_one_key_per_segment_in_order_and_skip_unresolved_hashes() {
        let spec = NamespaceSpec {
            segments: vec![64, 64],
            ..NamespaceSpec::default()
        };
        let (a, b) = (Digest([1; 32]), Digest([2; 32]));
        assert_eq!(
            page_keys(&[Some(a), None, Some(b)], &spec),
            [Key(a, 0), Key(a, 1), Key(b, 0), Key(b, 1)]
        );
    }
}
