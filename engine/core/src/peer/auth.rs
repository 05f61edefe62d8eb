//! Cluster-key loading and the HMAC-SHA256 challenge-response handshake (both directions).
//!
//! Each side sends a fresh 32-byte nonce and proves knowledge of the key by an HMAC over
//! both nonces under a side-specific label; the key itself never crosses the wire.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use hmac::{Hmac, Mac};
use kvnode_proto::peer::{
    DEST_PROOF_LABEL, NONCE_LEN, PEER_PROTOCOL_VERSION, PeerMsg, SOURCE_PROOF_LABEL,
};
use sha2::Sha256;

use super::PeerError;
use super::transport::TcpConn;

/// The shared cluster key. Its bytes are never logged or sent.
#[derive(Clone)]
pub struct ClusterKey(Vec<u8>);

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(<redacted>)")
    }
}

impl ClusterKey {
    /// Reads a key file: its contents with surrounding whitespace trimmed, at least 16 bytes.
    pub fn load(path: &Path) -> Result<Self, PeerError> {
        let raw = std::fs::read(path)
            .map_err(|e| PeerError::Key(format!("cannot read {}: {e}", path.display())))?;
        let s = raw.trim_ascii();
        if s.len() < 16 {
            return Err(PeerError::Key(format!(
                "{} holds {} bytes; a cluster key needs at least 16 (e.g. `head -c 32 /dev/urandom | base64`)",
                path.display(),
                s.len()
            )));
        }
        Ok(Self(s.to_vec()))
    }

    /// From raw bytes (tests).
    pub fn from_bytes(b: &[u8]) -> Self {
        Self(b.to_vec())
    }

    fn mac(&self, label: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(first);
        m.update(second);
        m
    }

    /// HMAC(key, label || first || second).
    pub fn proof(&self, label: &[u8], first: &[u8], second: &[u8]) -> Vec<u8> {
        self.mac(label, first, second)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Constant-time check of a proof.
    pub fn verify(&self, label: &[u8], first: &[u8], second: &[u8], proof: &[u8]) -> bool {
        self.mac(label, first, second).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce (getrandom(2)).
pub fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    let mut got = 0;
    while got < NONCE_LEN {
        // SAFETY: writing into our own buffer of the given length.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), NONCE_LEN - got, 0) };
        assert!(
            r > 0,
            "getrandom failed: {}",
            std::io::Error::last_os_error()
        );
        got += r as usize;
    }
    n
}

/// Destination side: authenticates the source and itself. Bounded by `limit` overall.
pub async fn dial_handshake(
    w: &mut TcpConn,
    key: Option<&ClusterKey>,
    node: &str,
    limit: Duration,
) -> Result<String, PeerError> {
    let mine = nonce();
    w.send(
        &PeerMsg::Hello {
            version: PEER_PROTOCOL_VERSION,
            node: node.to_owned(),
            nonce: mine.clone(),
            keyed: key.is_some(),
        },
        &[],
        limit,
    )
    .await?;
    let (theirs, proof, src) = match w.recv(limit).await?.0 {
        PeerMsg::Challenge {
            version,
            node,
            nonce,
            proof,
        } if version == PEER_PROTOCOL_VERSION => (nonce, proof, node),
        PeerMsg::Refused { reason } => return Err(PeerError::Refused(reason)),
        other => {
            return Err(PeerError::Protocol(format!(
                "expected Challenge, got {other:?}"
            )));
        }
    };
    let answer = match key {
        Some(k) if k.verify(SOURCE_PROOF_LABEL, &mine, &theirs, &proof) => {
            k.proof(DEST_PROOF_LABEL, &theirs, &mine)
        }
        Some(_) => {
            return Err(PeerError::Auth(
                "source failed the cluster-key challenge (wrong cluster key?)".into(),
            ));
        }
        None if proof.is_empty() => Vec::new(),
        None => {
            return Err(PeerError::Auth(
                "source uses a cluster key and this daemon has none".into(),
            ));
        }
    };
    w.send(&PeerMsg::Auth { proof: answer }, &[], limit).await?;
    match w.recv(limit).await?.0 {
        PeerMsg::Ready => Ok(src),
        PeerMsg::Refused { reason } => Err(PeerError::Refused(reason)),
        other => Err(PeerError::Protocol(format!(
            "expected Ready, got {other:?}"
        ))),
    }
}

/// Source side: checks the destination. On failure a `Refused` frame says why.
pub async fn accept_handshake(
    w: &mut TcpConn,
    key: Option<&ClusterKey>,
    node: &str,
    limit: Duration,
) -> Result<String, PeerError> {
    let r = accept_inner(w, key, node, limit).await;
    if let Err(e) = &r
        && !matches!(e, PeerError::Io(_) | PeerError::Timeout(..))
    {
        let _ = w
            .send(
                &PeerMsg::Refused {
                    reason: e.to_string(),
                },
                &[],
                limit,
            )
            .await;
    }
    r
}

async fn accept_inner(
    w: &mut TcpConn,
    key: Option<&ClusterKey>,
    node: &str,
    limit: Duration,
) -> Result<String, PeerError> {
    let (theirs, keyed, dst) = match w.recv(limit).await?.0 {
        PeerMsg::Hello {
            version,
            node,
            nonce,
            keyed,
        } if version == PEER_PROTOCOL_VERSION => (nonce, keyed, node),
        PeerMsg::Hello { version, .. } => {
            return Err(PeerError::Protocol(format!(
                "peer protocol version {version} not supported (this daemon speaks {PEER_PROTOCOL_VERSION})"
            )));
        }
        other => {
            return Err(PeerError::Protocol(format!(
                "expected Hello, got {other:?}"
            )));
        }
    };
    match (key.is_some(), keyed) {
        (true, false) => return Err(PeerError::Auth("this daemon requires a cluster key".into())),
        (false, true) => return Err(PeerError::Auth("this daemon has no cluster key".into())),
        (false, false) if !w.remote().ip().to_canonical().is_loopback() => {
            return Err(PeerError::Auth(
                "without a cluster key only loopback peers are served".into(),
            ));
        }
        _ => {}
    }
    let mine = nonce();
    let proof = key
        .map(|k| k.proof(SOURCE_PROOF_LABEL, &theirs, &mine))
        .unwrap_or_default();
    w.send(
        &PeerMsg::Challenge {
            version: PEER_PROTOCOL_VERSION,
            node: node.to_owned(),
            nonce: mine.clone(),
            proof,
        },
        &[],
        limit,
    )
    .await?;
    let proof = match w.recv(limit).await?.0 {
        PeerMsg::Auth { proof } => proof,
        other => return Err(PeerError::Protocol(format!("expected Auth, got {other:?}"))),
    };
    if let Some(k) = key
        && !k.verify(DEST_PROOF_LABEL, &mine, &theirs, &proof)
    {
        return Err(PeerError::Auth(
            "wrong cluster key: the peer failed the challenge".into(),
        ));
    }
    w.send(&PeerMsg::Ready, &[], limit).await?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_label_the_key_and_both_nonces() {
        let k = ClusterKey::from_bytes(b"0123456789abcdef");
        let p = k.proof(SOURCE_PROOF_LABEL, b"a", b"b");
        assert!(k.verify(SOURCE_PROOF_LABEL, b"a", b"b", &p));
        assert!(!k.verify(DEST_PROOF_LABEL, b"a", b"b", &p));
        assert!(!k.verify(SOURCE_PROOF_LABEL, b"b", b"a", &p));
        let other = ClusterKey::from_bytes(b"0123456789abcdeX");
        assert!(!other.verify(SOURCE_PROOF_LABEL, b"a", b"b", &p));
        assert_eq!(format!("{k:?}"), "ClusterKey(<redacted>)");
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce(), nonce());
    }
}
