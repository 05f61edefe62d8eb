//! The router entry (docs/router-entry.md): a router sends a hints envelope straight to a
//! node's daemon over HTTP, before any engine sees the request (a prefetch at placement).
//!
//! Requests are signed with a **router key** derived from a cluster key, so only a holder of
//! the cluster key (or of the derived key alone, which cannot run a peer handshake) can act.
//! Everything here uses HMAC-SHA256 so that a router in any language can sign with its
//! standard library:
//!
//! - router key = `HMAC-SHA256(cluster key line, "kvnode router entry key v1")`
//! - key id = the first 8 bytes of `HMAC-SHA256(router key, "kvnode router key id v1")`, as
//!   16 lowercase hex characters (header `x-kvnode-key-id`)
//! - signature = `HMAC-SHA256(router key, signing input)` as 64 lowercase hex characters
//!   (header `x-kvnode-signature`), where the signing input is
//!   `"kvnode-router-v1\n" + key id + "\n" + timestamp + "\n" + METHOD + " " + PATH + "\n" + body`
//!   and the timestamp (header `x-kvnode-timestamp`) is the sender's clock in Unix
//!   milliseconds, decimal.
//!
//! The daemon refuses a request whose timestamp is more than [`MAX_SKEW_MS`] from its own
//! clock, and a signature it has already accepted within that window (no replay).

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::key::encode_hex as hex;
use crate::pull::ActionResult;

/// The one path the router entry serves (POST).
pub const ACT_PATH: &str = "/v1/act";
/// Header: the router key's id.
pub const HEADER_KEY_ID: &str = "x-kvnode-key-id";
/// Header: the sender's clock, Unix milliseconds.
pub const HEADER_TIMESTAMP: &str = "x-kvnode-timestamp";
/// Header: the request's signature.
pub const HEADER_SIGNATURE: &str = "x-kvnode-signature";
/// Largest clock difference accepted, either way.
pub const MAX_SKEW_MS: u64 = 30_000;
/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;

const ROUTER_KEY_LABEL: &[u8] = b"kvnode router entry key v1";
const KEY_ID_LABEL: &[u8] = b"kvnode router key id v1";
const SIGNING_PREFIX: &[u8] = b"kvnode-router-v1\n";

/// What a router sends: the model whose namespaces on this node act, and the envelope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterRequest {
    /// The engines' model (`NamespaceSpec::model`): every namespace of that model registered
    /// on this node acts (one per tensor-parallel rank, and per tenant salt).
    pub model: String,
    /// Only the namespace with this id (32 hex characters, as `kvnode stats` shows it).
    #[serde(default)]
    pub namespace: Option<String>,
    /// The hints envelope (docs/client-protocol.md, "Router actions"): a JSON object, or the
    /// same as a string.
    pub hints: serde_json::Value,
}

impl RouterRequest {
    /// The envelope as text, for the envelope parser.
    pub fn hints_text(&self) -> String {
        match &self.hints {
            serde_json::Value::String(s) => s.clone(),
            v => v.to_string(),
        }
    }
}

/// What the actions did in one namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamespaceActed {
    /// Namespace id (32 hex characters).
    pub namespace: String,
    /// Its tensor-parallel rank.
    pub tp_rank: u32,
    /// One result per action of the envelope, in its order.
    pub results: Vec<ActionResult>,
}

/// The answer to an accepted request (HTTP 200).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterReply {
    /// The envelope's `message_id`.
    pub message_id: String,
    /// One entry per namespace that acted.
    pub namespaces: Vec<NamespaceActed>,
}

/// The answer to a refused request (any status but 200).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterRefusal {
    /// Why, for the router's log.
    pub error: String,
}

/// HMAC-SHA256 (RFC 2104).
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.map(|x| x ^ b);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// The router key derived from one cluster key (a line of the cluster key file).
pub fn router_key(cluster_key: &[u8]) -> [u8; 32] {
    hmac_sha256(cluster_key, ROUTER_KEY_LABEL)
}

/// The id of a router key, as sent in [`HEADER_KEY_ID`].
pub fn key_id(router_key: &[u8; 32]) -> String {
    hex(&hmac_sha256(router_key, KEY_ID_LABEL)[..8])
}

/// The bytes a signature covers.
pub fn signing_input(
    key_id: &str,
    timestamp_ms: u64,
    method: &str,
    path: &str,
    body: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNING_PREFIX.len() + 64 + path.len() + body.len());
    m.extend_from_slice(SIGNING_PREFIX);
    m.extend_from_slice(format!("{key_id}\n{timestamp_ms}\n{method} {path}\n").as_bytes());
    m.extend_from_slice(body);
    m
}

/// The signature of a request, as sent in [`HEADER_SIGNATURE`].
pub fn sign(
    router_key: &[u8; 32],
    timestamp_ms: u64,
    method: &str,
    path: &str,
    body: &[u8],
) -> String {
    let id = key_id(router_key);
    hex(&hmac_sha256(
        router_key,
        &signing_input(&id, timestamp_ms, method, path, body),
    ))
}

/// Whether `given` (hex, as received) is the signature of the request, compared in constant
/// time over its bytes.
pub fn signature_ok(
    router_key: &[u8; 32],
    given: &str,
    timestamp_ms: u64,
    method: &str,
    path: &str,
    body: &[u8],
) -> bool {
    let want = sign(router_key, timestamp_ms, method, path, body);
    given.len() == want.len()
        && given
            .bytes()
            .zip(want.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 1, 2 and 6 (a key longer than the block).
        let k1 = [0x0bu8; 20];
        assert_eq!(
            hmac_sha256(&k1, b"Hi There").to_vec(),
            unhex("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7")
        );
        assert_eq!(
            hmac_sha256(b"Jefe", b"what do ya want for nothing?").to_vec(),
            unhex("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        );
        let k6 = [0xaau8; 131];
        assert_eq!(
            hmac_sha256(
                &k6,
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )
            .to_vec(),
            unhex("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54")
        );
    }

    #[test]
    fn a_signature_covers_key_time_method_path_and_body() {
        let k = router_key(b"0123456789abcdef0123");
        let s = sign(&k, 1000, "POST", ACT_PATH, b"{}");
        assert!(signature_ok(&k, &s, 1000, "POST", ACT_PATH, b"{}"));
        assert!(!signature_ok(&k, &s, 1001, "POST", ACT_PATH, b"{}"));
        assert!(!signature_ok(&k, &s, 1000, "GET", ACT_PATH, b"{}"));
        assert!(!signature_ok(&k, &s, 1000, "POST", "/v1/other", b"{}"));
        assert!(!signature_ok(&k, &s, 1000, "POST", ACT_PATH, b"{ }"));
        let other = router_key(b"0123456789abcdef0124");
        assert!(!signature_ok(&other, &s, 1000, "POST", ACT_PATH, b"{}"));
        assert!(!signature_ok(&k, &s[..63], 1000, "POST", ACT_PATH, b"{}"));
        assert_ne!(key_id(&k), key_id(&other));
        assert_eq!(key_id(&k).len(), 16);
    }

    #[test]
    fn requests_refuse_unknown_fields_and_take_the_envelope_as_object_or_text() {
        let r: RouterRequest =
            serde_json::from_str(r#"{"model":"m","hints":{"protocol_version":"1.0"}}"#).unwrap();
        assert_eq!(r.hints_text(), r#"{"protocol_version":"1.0"}"#);
        let r: RouterRequest =
            serde_json::from_str(r#"{"model":"m","hints":"{\"a\":1}"}"#).unwrap();
        assert_eq!(r.hints_text(), r#"{"a":1}"#);
        assert!(
            serde_json::from_str::<RouterRequest>(r#"{"model":"m","hints":{},"x":1}"#).is_err()
        );
        assert!(serde_json::from_str::<RouterRequest>(r#"{"hints":{}}"#).is_err());
    }

    proptest! {
        #[test]
        fn request_decoding_never_panics(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = serde_json::from_slice::<RouterRequest>(&b);
        }

        #[test]
        fn any_change_to_a_signed_body_breaks_the_signature(
            body in proptest::collection::vec(any::<u8>(), 1..128), i in any::<usize>(), x in 1u8..,
        ) {
            let k = router_key(b"a cluster key of some length");
            let s = sign(&k, 7, "POST", ACT_PATH, &body);
            let mut m = body.clone();
            let i = i % m.len();
            m[i] ^= x;
            prop_assert!(signature_ok(&k, &s, 7, "POST", ACT_PATH, &body));
            prop_assert!(!signature_ok(&k, &s, 7, "POST", ACT_PATH, &m));
        }
    }
}
