//! The router's intent: every action of a hints envelope (interop.md §3), parsed as untrusted
//! input, one result per action.
//!
//! `kv.fetch` is Dynamo's (parsed by [`crate::hint`]). `kv.retain` and `kv.evict` take the
//! block-addressed payloads of Dynamo's session hint policy (`block_hashes` as integers or
//! decimal strings, `ttl_seconds`, `priority`). `kv.prefetch`, `kv.release` and `kv.demote`
//! are kvnode's own, named in the same style until an RFC names them. An envelope-level fault
//! (not JSON, an unknown `protocol_version`, too many actions) refuses the whole envelope; a
//! fault in one action (an unknown `action_type` included) refuses that action alone, by name,
//! and the others still run.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::hint::{
    Endpoint, FetchHint, HashForm, HintError, MAX_HINT_BYTES, PROTOCOL_VERSIONS, block_hashes,
};
pub use crate::pull::{ActionOutcome, ActionResult, Refusal};
/// `action_version` of every action kvnode executes.
pub const ACTION_VERSION: &str = "1.0";
/// Most actions one envelope may carry.
pub const MAX_ACTIONS: usize = 32;
/// Longest retention one `kv.retain` may ask for.
pub const MAX_TTL: Duration = Duration::from_hours(24);
/// Longest `action_id` / `action_type` echoed back.
const MAX_ID_CHARS: usize = 128;

/// The action types kvnode executes.
pub const ACTION_TYPES: [&str; 6] = [
    "kv.fetch",
    "kv.prefetch",
    "kv.retain",
    "kv.release",
    "kv.demote",
    "kv.evict",
];

/// A parsed envelope: its id and one parse result per action, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// `message_id` (empty when absent).
    pub message_id: String,
    /// One entry per action.
    pub actions: Vec<Parsed>,
}

/// One action as parsed: its identity and its payload, or why it is refused.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// `action_id` (cut to 128 characters).
    pub action_id: String,
    /// `action_type` (cut to 128 characters).
    pub action_type: String,
    /// The action, or the reason it is refused.
    pub action: Result<Action, HintError>,
}

/// An action kvnode executes.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Pull the covered missing prefix from the named peer (as a hinted get does).
    Fetch(FetchHint),
    /// Start bringing the named blocks into DRAM now: pulled from `source` when given,
    /// promoted from this node's NVMe otherwise (and for blocks the node holds there).
    Prefetch {
        /// Peer holding the blocks.
        source: Option<Endpoint>,
        /// Router hashes, in prefix order.
        block_hashes: Vec<u64>,
    },
    /// Keep the named blocks in DRAM (eviction and demotion skip them) for `ttl`.
    Retain {
        /// Router hashes.
        block_hashes: Vec<u64>,
        /// How long.
        ttl: Duration,
        /// The router's priority (reported; retention is all-or-nothing within the quota).
        priority: u64,
    },
    /// End the named blocks' retention; they stay cached as ordinary blocks.
    Release {
        /// Router hashes.
        block_hashes: Vec<u64>,
    },
    /// Write the named blocks to NVMe now and free their DRAM.
    Demote {
        /// Router hashes.
        block_hashes: Vec<u64>,
    },
    /// End the named blocks' retention and remove them from every tier.
    Evict {
        /// Router hashes.
        block_hashes: Vec<u64>,
    },
}

impl Action {
    /// The router hashes the action names.
    pub fn block_hashes(&self) -> &[u64] {
        match self {
            Action::Fetch(f) => &f.block_hashes,
            Action::Prefetch { block_hashes, .. }
            | Action::Retain { block_hashes, .. }
            | Action::Release { block_hashes }
            | Action::Demote { block_hashes }
            | Action::Evict { block_hashes } => block_hashes,
        }
    }
}

fn field(field: &'static str, why: impl Into<String>) -> HintError {
    HintError::Field {
        field,
        why: why.into(),
    }
}

fn cut(s: &str) -> String {
    s.chars().take(MAX_ID_CHARS).collect()
}

fn text<'a>(o: &'a Map<String, Value>, k: &'static str) -> Result<Option<&'a str>, HintError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(field(k, format!("expected a string, got {v}"))),
    }
}

/// `execute_at`: only "now" (or absent) reaches the daemon; an engine seam defers
/// "request_completion" actions and sends them when the request ends.
fn now_only(o: &Map<String, Value>) -> Result<(), HintError> {
    match text(o, "execute_at")? {
        None | Some("now") => Ok(()),
        Some(other) => Err(field(
            "execute_at",
            format!(
                "{other:?}: the daemon executes actions when they arrive (\"now\"); an engine seam defers \"request_completion\" actions until the request ends"
            ),
        )),
    }
}

fn retain(o: &Map<String, Value>) -> Result<Action, HintError> {
    let ttl = match o.get("ttl_seconds") {
        Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
        Some(v) => return Err(field("ttl_seconds", format!("expected a number, got {v}"))),
        None => return Err(field("ttl_seconds", "missing")),
    };
    if !(ttl.is_finite() && ttl > 0.0 && ttl <= MAX_TTL.as_secs_f64()) {
        return Err(field(
            "ttl_seconds",
            format!("{ttl} is not in (0, {}]", MAX_TTL.as_secs()),
        ));
    }
    let priority = match o.get("priority") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| field("priority", format!("expected an integer >= 0, got {v}")))?,
    };
    Ok(Action::Retain {
        block_hashes: block_hashes(o, HashForm::IntegersOrDecimal)?,
        ttl: Duration::from_secs_f64(ttl),
        priority,
    })
}

fn action_of(kind: &str, o: &Map<String, Value>) -> Result<Action, HintError> {
    if kind == "kv.fetch" {
        return crate::hint::payload_of(o).map(Action::Fetch);
    }
    now_only(o)?;
    Ok(match kind {
        "kv.prefetch" => Action::Prefetch {
            source: text(o, "source_control_endpoint")?
                .map(Endpoint::parse)
                .transpose()?,
            block_hashes: block_hashes(o, HashForm::IntegersOrDecimal)?,
        },
        "kv.retain" => retain(o)?,
        "kv.release" => Action::Release {
            block_hashes: block_hashes(o, HashForm::IntegersOrDecimal)?,
        },
        "kv.demote" => Action::Demote {
            block_hashes: block_hashes(o, HashForm::IntegersOrDecimal)?,
        },
        "kv.evict" => Action::Evict {
            block_hashes: block_hashes(o, HashForm::IntegersOrDecimal)?,
        },
        other => return Err(HintError::UnknownAction(other.to_owned())),
    })
}

fn parse_one(a: &Value) -> Parsed {
    let Value::Object(a) = a else {
        return Parsed {
            action_id: String::new(),
            action_type: String::new(),
            action: Err(field("actions[]", "expected an object")),
        };
    };
    let id = a.get("action_id").and_then(Value::as_str).unwrap_or("");
    let kind = a.get("action_type").and_then(Value::as_str).unwrap_or("");
    let action = (|| {
        let kind = text(a, "action_type")?.ok_or_else(|| field("action_type", "missing"))?;
        if !ACTION_TYPES.contains(&kind) {
            return Err(HintError::UnknownAction(kind.to_owned()));
        }
        let v = text(a, "action_version")?.unwrap_or_default();
        if v != ACTION_VERSION {
            return Err(HintError::ActionVersion(v.to_owned()));
        }
        match a.get("payload") {
            Some(Value::Object(p)) => action_of(kind, p),
            _ => Err(field("payload", "expected an object")),
        }
    })();
    Parsed {
        action_id: cut(id),
        action_type: cut(kind),
        action,
    }
}

/// Parses a hints envelope (`{protocol_version, message_id, actions: [...]}`).
pub fn parse_envelope(s: &str) -> Result<Envelope, HintError> {
    if s.len() > MAX_HINT_BYTES {
        return Err(HintError::TooLarge(s.len()));
    }
    let v: Value = serde_json::from_str(s).map_err(|e| HintError::NotJson(e.to_string()))?;
    let Value::Object(o) = v else {
        return Err(HintError::NotJson("top level is not an object".into()));
    };
    let pv = text(&o, "protocol_version")?.unwrap_or_default();
    if !PROTOCOL_VERSIONS.contains(&pv) {
        return Err(HintError::ProtocolVersion(pv.to_owned()));
    }
    let Some(Value::Array(actions)) = o.get("actions") else {
        return Err(field("actions", "expected an array"));
    };
    if actions.len() > MAX_ACTIONS {
        return Err(field(
            "actions",
            format!(
                "{} actions, more than the {MAX_ACTIONS} limit",
                actions.len()
            ),
        ));
    }
    Ok(Envelope {
        message_id: cut(text(&o, "message_id")?.unwrap_or_default()),
        actions: actions.iter().map(parse_one).collect(),
    })
}

#[cfg(test)]
mod tests;
