//! Router hints: Dynamo's `kv.fetch` envelope and the compact form (interop.md §3), parsed and
//! validated as untrusted input. Authorization of the endpoint happens in the engine.

use std::fmt;
use std::net::IpAddr;

use serde_json::Value;

use crate::key::Key;

/// Envelope `protocol_version` of Dynamo's `kv.fetch` envelope.
pub const HINT_PROTOCOL_VERSION: &str = "0.1";
/// Envelope `protocol_version`s accepted: Dynamo's `kv.fetch` envelope ("0.1") and its typed
/// `KvHint` ("1.0").
pub const PROTOCOL_VERSIONS: [&str; 2] = [HINT_PROTOCOL_VERSION, "1.0"];
/// `kv.fetch` `action_version` accepted.
pub const FETCH_ACTION_VERSION: &str = "1.0";
/// Largest hint text accepted.
pub const MAX_HINT_BYTES: usize = 1 << 20;
/// Most block hashes one hint may name.
pub const MAX_HINT_HASHES: usize = 65_536;

/// Why a hint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HintError {
    /// Not JSON, or not an object.
    #[error("hint is not a JSON object: {0}")]
    NotJson(String),
    /// Larger than [`MAX_HINT_BYTES`].
    #[error("hint is {0} bytes, more than the {MAX_HINT_BYTES}-byte limit")]
    TooLarge(usize),
    /// Unknown envelope version.
    #[error("hint protocol_version {0:?} is not supported (expected \"0.1\" or \"1.0\")")]
    ProtocolVersion(String),
    /// No `kv.fetch` action.
    #[error("hint carries no kv.fetch action")]
    NoFetch,
    /// Unknown action version.
    #[error("action_version {0:?} is not supported (expected \"1.0\")")]
    ActionVersion(String),
    /// An action type this daemon does not execute.
    #[error(
        "action_type {0:?} is not executed by kvnode (it executes kv.fetch, kv.prefetch, kv.retain, kv.release, kv.demote and kv.evict)"
    )]
    UnknownAction(String),
    /// A field missing or of the wrong type.
    #[error("hint field {field}: {why}")]
    Field {
        /// JSON path of the field.
        field: &'static str,
        /// What is wrong.
        why: String,
    },
    /// `block_hashes` empty.
    #[error("hint block_hashes is empty")]
    EmptyHashes,
    /// More than [`MAX_HINT_HASHES`] hashes.
    #[error("hint names {0} block hashes, more than the {MAX_HINT_HASHES} limit")]
    TooManyHashes(usize),
    /// A hash that is not an integer in u64 range.
    #[error("hint block_hashes[{index}] = {value} is not an integer in 0..=2^64-1")]
    HashRange {
        /// Position.
        index: usize,
        /// The offending JSON value.
        value: String,
    },
    /// Endpoint not `tcp://host:port` with a port in 1..=65535.
    #[error("hint endpoint {0:?} is not tcp://host:port with port 1..=65535")]
    Endpoint(String),
    /// Endpoint names a bind wildcard.
    #[error("hint endpoint {0:?} is a bind wildcard, not a dialable peer")]
    Wildcard(String),
    /// Unknown copy mode.
    #[error("kv.fetch mode {0:?} is not supported (expected \"copy\")")]
    Mode(String),
    /// The hashes do not match the request's first page.
    #[error(
        "hint block_hashes (first {hint:#x}) do not contain the request's first page (router hash {page:#x}): the hint is for another prefix"
    )]
    NoOverlap {
        /// The hint's first hash.
        hint: u64,
        /// The first page's router hash.
        page: u64,
    },
}

/// A peer endpoint `tcp://host:port`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// Port, 1..=65535.
    pub port: u16,
}

impl Endpoint {
    /// Parses `tcp://host:port` (IPv6 as `tcp://[::1]:port`), refusing wildcards.
    pub fn parse(s: &str) -> Result<Self, HintError> {
        let bad = || HintError::Endpoint(s.to_owned());
        let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let host = match host.strip_prefix('[') {
            Some(h) => h.strip_suffix(']').ok_or_else(bad)?,
            None if host.contains(':') => return Err(bad()),
            None => host,
        };
        if host == "*" {
            return Err(HintError::Wildcard(s.to_owned()));
        }
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_');
        if host.is_empty() || host.len() > 253 || !host.chars().all(valid_char) {
            return Err(bad());
        }
        if !port.bytes().all(|b| b.is_ascii_digit()) || port.is_empty() {
            return Err(bad());
        }
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            return Err(bad());
        }
        if host.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(HintError::Wildcard(s.to_owned()));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }

    /// The host as an IP address, if it is a literal.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "tcp://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "tcp://{}:{}", self.host, self.port)
        }
    }
}

/// A validated `kv.fetch` hint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchHint {
    /// Where the router says the prefix is.
    pub endpoint: Endpoint,
    /// Router hashes of the source's root-aligned prefix, in order.
    pub block_hashes: Vec<u64>,
}

fn field(field: &'static str, why: impl Into<String>) -> HintError {
    HintError::Field {
        field,
        why: why.into(),
    }
}

fn str_field<'a>(
    o: &'a serde_json::Map<String, Value>,
    k: &'static str,
) -> Result<Option<&'a str>, HintError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(field(k, format!("expected a string, got {v}"))),
    }
}

/// How a payload may write its hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HashForm {
    /// JSON integers only (`kv.fetch`, as Dynamo's router writes it).
    Integers,
    /// Integers or decimal strings (Dynamo's session policy writes `kv.retain` / `kv.evict`
    /// hashes as strings).
    IntegersOrDecimal,
}

/// `block_hashes`: a non-empty array of at most [`MAX_HINT_HASHES`] u64 in `form`.
pub(crate) fn block_hashes(
    o: &serde_json::Map<String, Value>,
    form: HashForm,
) -> Result<Vec<u64>, HintError> {
    let a = match o.get("block_hashes") {
        Some(Value::Array(a)) => a,
        Some(v) => return Err(field("block_hashes", format!("expected an array, got {v}"))),
        None => return Err(field("block_hashes", "missing")),
    };
    if a.is_empty() {
        return Err(HintError::EmptyHashes);
    }
    if a.len() > MAX_HINT_HASHES {
        return Err(HintError::TooManyHashes(a.len()));
    }
    a.iter()
        .enumerate()
        .map(|(index, v)| {
            let n = match v {
                Value::String(s)
                    if form == HashForm::IntegersOrDecimal
                        && s.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    s.parse().ok()
                }
                v => v.as_u64(),
            };
            n.ok_or_else(|| HintError::HashRange {
                index,
                value: v.to_string(),
            })
        })
        .collect()
}

pub(crate) fn payload_of(o: &serde_json::Map<String, Value>) -> Result<FetchHint, HintError> {
    if let Some(m) = str_field(o, "mode")?
        && m != "copy"
    {
        return Err(HintError::Mode(m.to_owned()));
    }
    let ep = str_field(o, "source_control_endpoint")?
        .ok_or_else(|| field("source_control_endpoint", "missing"))?;
    let endpoint = Endpoint::parse(ep)?;
    let block_hashes = block_hashes(o, HashForm::Integers)?;
    Ok(FetchHint {
        endpoint,
        block_hashes,
    })
}

/// Parses a hint: the `kv.fetch` envelope or the compact `{source_control_endpoint,
/// block_hashes}` form. The first `kv.fetch` action is used; other action types are ignored.
pub fn parse_hint(text: &str) -> Result<FetchHint, HintError> {
    if text.len() > MAX_HINT_BYTES {
        return Err(HintError::TooLarge(text.len()));
    }
    let v: Value = serde_json::from_str(text).map_err(|e| HintError::NotJson(e.to_string()))?;
    let Value::Object(o) = v else {
        return Err(HintError::NotJson("top level is not an object".into()));
    };
    if !o.contains_key("actions") && !o.contains_key("protocol_version") {
        return payload_of(&o);
    }
    let pv = str_field(&o, "protocol_version")?.unwrap_or_default();
    if !PROTOCOL_VERSIONS.contains(&pv) {
        return Err(HintError::ProtocolVersion(pv.to_owned()));
    }
    let Some(Value::Array(actions)) = o.get("actions") else {
        return Err(field("actions", "expected an array"));
    };
    for a in actions {
        let Value::Object(a) = a else {
            return Err(field("actions[]", "expected an object"));
        };
        if str_field(a, "action_type")? != Some("kv.fetch") {
            continue;
        }
        let av = str_field(a, "action_version")?.unwrap_or_default();
        if av != FETCH_ACTION_VERSION {
            return Err(HintError::ActionVersion(av.to_owned()));
        }
        return match a.get("payload") {
            Some(Value::Object(p)) => payload_of(p),
            _ => Err(field("payload", "expected an object")),
        };
    }
    Err(HintError::NoFetch)
}

/// How many leading `keys` the hint covers. Keys are grouped into pages by consecutive equal
/// digests (several segments of one page). The hint is root-aligned and the request may start
/// further down the chain (earlier pages already held elsewhere), so the request's first page
/// is located in `hashes` and pages are matched from there while each router hash agrees.
pub fn covered_keys(hashes: &[u64], keys: &[Key]) -> Result<usize, HintError> {
    let Some(first) = keys.first() else {
        return Ok(0);
    };
    let Some(start) = hashes.iter().position(|&h| h == first.0.router_hash()) else {
        return Err(HintError::NoOverlap {
            hint: hashes.first().copied().unwrap_or_default(),
            page: first.0.router_hash(),
        });
    };
    let mut page = start;
    let mut prev = first.0;
    for (i, k) in keys.iter().enumerate() {
        if k.0 != prev {
            page += 1;
            prev = k.0;
        }
        if hashes.get(page) != Some(&k.0.router_hash()) {
            return Ok(i);
        }
    }
    Ok(keys.len())
}

#[cfg(test)]
mod tests;
