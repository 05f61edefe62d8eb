//! Cluster keys and the peer handshake (docs/peer-protocol.md, "Handshake").
//!
//! Each side sends a fresh 32-byte nonce. Both proofs are BLAKE3 `derive_key` outputs over
//! the cluster key and a hash of the whole transcript: both nonces, the destination's
//! identity, the endpoint it dialled, the source's identity, the key id and the session mode;
//! each role has its own derivation context. So a proof is valid only for this pair of nonces,
//! these two daemons and this role: relayed to another connection or reflected back it fails.
//! The same secret (key || transcript) yields the per-direction session keys of
//! [`Channel`](super::transport::channel::Channel). The key never crosses the wire; a key is
//! named by its id, a 64-bit fingerprint.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::{HASH_LEN, MAX_KEY_IDS, NONCE_LEN, PEER_PROTOCOL_VERSION, PeerMsg};

use kvnode_blockmac::BlockMac;

use super::error::{Expected, HandshakeError, KeyIds, KeyProblem, Me, Verbatim};
use super::transport::TcpConn;
use super::transport::channel::{Channel, Side};
use super::{ConfigError, PeerError, WireError};

const KEY_ID_CTX: &str = "kvnode 2026-12 peer cluster key id";
const SOURCE_PROOF_CTX: &str = "kvnode 2026-12 peer v2 source proof";
const DEST_PROOF_CTX: &str = "kvnode 2026-12 peer v2 destination proof";
const TRANSCRIPT_LABEL: &[u8] = b"kvnode peer v2 handshake transcript";

/// One shared cluster key. Its bytes are never logged or sent; its id is.
#[derive(Clone)]
pub struct ClusterKey {
    bytes: Vec<u8>,
    id: u64,
    /// The block MAC under this key, where the CPU can compute it fast.
    mac: Option<Arc<BlockMac>>,
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterKey(id {:016x}, <redacted>)", self.id)
    }
}

impl ClusterKey {
    /// From raw bytes (at least 16; shorter keys are refused when loaded from a file).
    pub fn from_bytes(b: &[u8]) -> Self {
        let d = blake3::derive_key(KEY_ID_CTX, b);
        let id = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        Self {
            bytes: b.to_vec(),
            id,
            mac: BlockMac::for_key(id, b).map(Arc::new),
        }
    }

    /// The router entry's key derived from this key (`kvnode_proto::router`).
    pub fn router_key(&self) -> [u8; 32] {
        kvnode_proto::router::router_key(&self.bytes)
    }

    /// The block MAC of plaintext sessions under this key (`None`: verify by BLAKE3).
    pub fn block_mac(&self) -> Option<&Arc<BlockMac>> {
        self.mac.as_ref()
    }

    /// The key's id: a 64-bit fingerprint, safe to log and send.
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// Largest cluster key file read (two keys of any sensible length fit many times).
pub const MAX_KEY_FILE: u64 = 64 << 10;

fn read_key_file(path: &Path) -> Result<Vec<u8>, PeerError> {
    use std::io::Read as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let bad = |problem| -> PeerError {
        ConfigError::Key {
            path: path.to_owned(),
            problem,
        }
        .into()
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| bad(KeyProblem::Open(e)))?;
    let md = f.metadata().map_err(|e| bad(KeyProblem::Stat(e)))?;
    if !md.file_type().is_file() {
        return Err(bad(KeyProblem::NotRegular));
    }
    if md.len() > MAX_KEY_FILE {
        return Err(bad(KeyProblem::TooLong {
            bytes: md.len(),
            max: MAX_KEY_FILE,
        }));
    }
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{mode:03o}"), "CLUSTER KEY FILE IS READABLE BY OTHER USERS: anyone who reads it can join the cluster; chmod 0600 it");
    }
    let mut raw = Vec::new();
    f.take(MAX_KEY_FILE + 1)
        .read_to_end(&mut raw)
        .map_err(|e| bad(KeyProblem::Read(e)))?;
    if raw.len() as u64 > MAX_KEY_FILE {
        return Err(bad(KeyProblem::TooLong {
            bytes: raw.len() as u64,
            max: MAX_KEY_FILE,
        }));
    }
    Ok(raw)
}

/// The cluster keys a daemon accepts: the current one, and during a roll the next (or the
/// previous) one. Read from one file, one key per line.
#[derive(Clone, Debug)]
pub struct KeyRing {
    keys: Vec<ClusterKey>,
}

impl KeyRing {
    /// Reads a key file: one or two keys, one per line (blank lines ignored, surrounding
    /// whitespace trimmed), each at least 16 bytes. The first is this daemon's preferred key.
    ///
    /// The file must be a regular file (a FIFO or device is refused without blocking: it is
    /// opened non-blocking) of at most [`MAX_KEY_FILE`] bytes; one that group or others may
    /// read is used with a loud warning.
    pub fn load(path: &Path) -> Result<Self, PeerError> {
        let raw = read_key_file(path)?;
        let lines: Vec<&[u8]> = raw
            .split(|&b| b == b'\n')
            .map(<[u8]>::trim_ascii)
            .filter(|l| !l.is_empty())
            .collect();
        let bad = |problem| -> PeerError {
            ConfigError::Key {
                path: path.to_owned(),
                problem,
            }
            .into()
        };
        if lines.is_empty() || lines.len() > MAX_KEY_IDS {
            return Err(bad(KeyProblem::KeyCount {
                found: lines.len(),
                max: MAX_KEY_IDS,
            }));
        }
        if let Some(short) = lines.iter().find(|l| l.len() < 16) {
            return Err(bad(KeyProblem::ShortKey { bytes: short.len() }));
        }
        if lines.len() == 2 && lines[0] == lines[1] {
            return Err(bad(KeyProblem::Duplicate));
        }
        Ok(Self::from_keys(
            lines.into_iter().map(ClusterKey::from_bytes).collect(),
        ))
    }

    /// From keys (tests), preferred first.
    pub fn from_keys(keys: Vec<ClusterKey>) -> Self {
        Self { keys }
    }

    /// The keys held, preferred first.
    pub fn keys(&self) -> &[ClusterKey] {
        &self.keys
    }

    /// Ids of the keys held, preferred first.
    pub fn ids(&self) -> Vec<u64> {
        self.keys.iter().map(ClusterKey::id).collect()
    }

    /// The key with this id, if held.
    pub fn get(&self, id: u64) -> Option<&ClusterKey> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// The first of this daemon's keys that the peer also holds.
    pub fn pick(&self, offered: &[u64]) -> Option<&ClusterKey> {
        self.keys.iter().find(|k| offered.contains(&k.id))
    }

    /// Key ids as text for logs.
    pub fn describe(&self) -> String {
        let ids: Vec<String> = self.ids().iter().map(|i| format!("{i:016x}")).collect();
        ids.join(", ")
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

fn field(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&(b.len() as u64).to_le_bytes());
    h.update(b);
}

/// The hash of a handshake: every field of `Hello` and of `Challenge` but its proof.
pub fn transcript(hello: &PeerMsg, challenge: &PeerMsg) -> Result<[u8; 32], PeerError> {
    let (
        PeerMsg::Hello {
            version,
            node: dst,
            dialled,
            nonce: nd,
            key_ids,
            encrypt: want,
        },
        PeerMsg::Challenge {
            version: v2,
            node: src,
            nonce: ns,
            key_id,
            encrypt,
            ..
        },
    ) = (hello, challenge)
    else {
        return Err(HandshakeError::Unexpected {
            expected: Expected::Challenge,
            got: Box::new(challenge.clone()),
        }
        .into());
    };
    let mut h = blake3::Hasher::new();
    field(&mut h, TRANSCRIPT_LABEL);
    field(&mut h, &version.to_le_bytes());
    field(&mut h, dst.as_bytes());
    field(&mut h, dialled.as_bytes());
    field(&mut h, nd);
    let ids: Vec<u8> = key_ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    field(&mut h, &ids);
    field(&mut h, &[u8::from(*want)]);
    field(&mut h, &v2.to_le_bytes());
    field(&mut h, src.as_bytes());
    field(&mut h, ns);
    field(&mut h, &key_id.map(u64::to_le_bytes).unwrap_or_default());
    field(&mut h, &[u8::from(key_id.is_some()), u8::from(*encrypt)]);
    Ok(*h.finalize().as_bytes())
}

/// The session secret: the key (empty when keyless) followed by the transcript hash.
pub fn secret(key: Option<&ClusterKey>, th: &[u8; 32]) -> Vec<u8> {
    let mut s = key.map(|k| k.bytes.clone()).unwrap_or_default();
    s.extend_from_slice(th);
    s
}

/// The source's proof for a session secret.
pub fn source_proof(secret: &[u8]) -> [u8; HASH_LEN] {
    blake3::derive_key(SOURCE_PROOF_CTX, secret)
}

/// The destination's proof for a session secret.
pub fn dest_proof(secret: &[u8]) -> [u8; HASH_LEN] {
    blake3::derive_key(DEST_PROOF_CTX, secret)
}

/// Constant-time comparison of a received proof with the expected one.
fn proof_ok(want: [u8; HASH_LEN], got: &[u8]) -> bool {
    <[u8; HASH_LEN]>::try_from(got).is_ok_and(|g| blake3::Hash::from(want) == blake3::Hash::from(g))
}

/// What a daemon says about itself in a handshake.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The advertised endpoint, or a name when there is none.
    pub node: String,
    /// The advertised endpoint, if any.
    pub advertised: Option<Endpoint>,
}

/// Whether `dialled` names the daemon that accepted on `local`: it is the advertised
/// endpoint, or its port is `local`'s and its host resolves to `local`'s address.
pub async fn names_me(dialled: &str, me: &Identity, local: SocketAddr) -> bool {
    let Ok(e) = Endpoint::parse(dialled) else {
        return false;
    };
    if me
        .advertised
        .as_ref()
        .is_some_and(|a| a.host.eq_ignore_ascii_case(&e.host) && a.port == e.port)
    {
        return true;
    }
    if e.port != local.port() {
        return false;
    }
    let mine = local.ip().to_canonical();
    if let Some(ip) = e.ip() {
        return ip.to_canonical() == mine;
    }
    tokio::net::lookup_host((e.host.as_str(), e.port))
        .await
        .is_ok_and(|mut a| a.any(|a| a.ip().to_canonical() == mine))
}

/// Destination side: authenticates the source and itself, then seals the connection.
/// `dialled` is the endpoint this daemon connected to. Returns the source's name.
pub async fn dial_handshake(
    w: &mut TcpConn,
    ring: Option<&KeyRing>,
    me: &str,
    dialled: &Endpoint,
    encrypt: bool,
    limit: Duration,
) -> Result<String, PeerError> {
    let mine = nonce();
    let hello = PeerMsg::Hello {
        version: PEER_PROTOCOL_VERSION,
        node: me.to_owned(),
        dialled: dialled.to_string(),
        nonce: mine.clone(),
        key_ids: ring.map(KeyRing::ids).unwrap_or_default(),
        encrypt,
    };
    w.send(&hello, &[], limit).await?;
    let challenge = w.recv(limit).await?.0;
    let (theirs, key_id, sealed, proof, src) = match &challenge {
        PeerMsg::Challenge {
            version,
            node,
            nonce,
            key_id,
            encrypt,
            proof,
        } if *version == PEER_PROTOCOL_VERSION => (nonce, *key_id, *encrypt, proof, node.clone()),
        PeerMsg::Refused { reason } => {
            return Err(HandshakeError::Refused(reason.as_str().into()).into());
        }
        other => return Err(unexpected(Expected::Challenge, other.clone())),
    };
    if *theirs == mine {
        return Err(HandshakeError::Reflection.into());
    }
    let key = match (ring, key_id) {
        (Some(r), Some(id)) => Some(r.get(id).ok_or_else(|| HandshakeError::UnknownKey {
            id,
            held: KeyIds(r.ids()),
        })?),
        (Some(_), None) => return Err(HandshakeError::SourceKeyless.into()),
        (None, Some(_)) => return Err(HandshakeError::SourceKeyed.into()),
        (None, None) => None,
    };
    if encrypt && !sealed {
        return Err(HandshakeError::EncryptionDeclined.into());
    }
    let th = transcript(&hello, &challenge)?;
    let s = secret(key, &th);
    if !proof_ok(source_proof(&s), proof) {
        return Err(HandshakeError::SourceProof {
            dialled: dialled.clone(),
        }
        .into());
    }
    w.send(
        &PeerMsg::Auth {
            proof: dest_proof(&s).to_vec(),
        },
        &[],
        limit,
    )
    .await?;
    let mac = key.and_then(ClusterKey::block_mac).filter(|_| !sealed);
    w.secure(
        Channel::new(&s, sealed, Side::Destination)
            .with_key(key_id)
            .with_block_mac(mac.cloned()),
    );
    match w.recv_first_sealed(limit).await? {
        PeerMsg::Ready => Ok(src),
        PeerMsg::Refused { reason } => Err(HandshakeError::Refused(Verbatim(reason)).into()),
        other => Err(unexpected(Expected::Ready, other)),
    }
}

/// A handshake message other than the one due.
fn unexpected(expected: Expected, got: PeerMsg) -> PeerError {
    HandshakeError::Unexpected {
        expected,
        got: Box::new(got),
    }
    .into()
}

/// Source side: checks the destination, then seals the connection. On failure a plain
/// `Refused` frame says why. Returns the destination's name.
pub async fn accept_handshake(
    w: &mut TcpConn,
    ring: Option<&KeyRing>,
    me: &Identity,
    encrypt: bool,
    limit: Duration,
) -> Result<String, PeerError> {
    let r = accept_inner(w, ring, me, encrypt, limit).await;
    if let Err(e) = &r
        && !matches!(
            e,
            PeerError::Wire(WireError::Io(_) | WireError::Timeout { .. })
        )
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
    ring: Option<&KeyRing>,
    me: &Identity,
    encrypt: bool,
    limit: Duration,
) -> Result<String, PeerError> {
    let hello = w.recv(limit).await?.0;
    let (theirs, key_ids, dialled, want, dst) = match &hello {
        PeerMsg::Hello {
            version,
            node,
            dialled,
            nonce,
            key_ids,
            encrypt,
        } if *version == PEER_PROTOCOL_VERSION => (nonce, key_ids, dialled, *encrypt, node.clone()),
        PeerMsg::Hello { version, .. } => {
            return Err(HandshakeError::Version {
                theirs: *version,
                ours: PEER_PROTOCOL_VERSION,
            }
            .into());
        }
        other => return Err(unexpected(Expected::Hello, other.clone())),
    };
    let key = match ring {
        Some(_) if key_ids.is_empty() => return Err(HandshakeError::KeyRequired.into()),
        Some(r) => Some(r.pick(key_ids).ok_or_else(|| HandshakeError::NoCommonKey {
            theirs: KeyIds(key_ids.clone()),
            ours: KeyIds(r.ids()),
        })?),
        None if !key_ids.is_empty() => return Err(HandshakeError::Keyless.into()),
        None if !w.remote().ip().to_canonical().is_loopback() => {
            return Err(HandshakeError::KeylessRemote.into());
        }
        None => None,
    };
    let local = w.local();
    let named = tokio::time::timeout(limit, names_me(dialled, me, local))
        .await
        .unwrap_or(false);
    if !named {
        return Err(HandshakeError::NotDialled {
            dialled: dialled.as_str().into(),
            me: Me {
                advertised: me.advertised.clone(),
                local,
            },
        }
        .into());
    }
    let sealed = encrypt || want;
    let mut challenge = PeerMsg::Challenge {
        version: PEER_PROTOCOL_VERSION,
        node: me.node.clone(),
        nonce: nonce(),
        key_id: key.map(ClusterKey::id),
        encrypt: sealed,
        proof: Vec::new(),
    };
    if let PeerMsg::Challenge { nonce, .. } = &challenge
        && nonce == theirs
    {
        return Err(HandshakeError::NonceCollision.into());
    }
    let th = transcript(&hello, &challenge)?;
    let s = secret(key, &th);
    if let PeerMsg::Challenge { proof, .. } = &mut challenge {
        *proof = source_proof(&s).to_vec();
    }
    w.send(&challenge, &[], limit).await?;
    let proof = match w.recv(limit).await?.0 {
        PeerMsg::Auth { proof } => proof,
        other => return Err(unexpected(Expected::Auth, other)),
    };
    if !proof_ok(dest_proof(&s), &proof) {
        return Err(HandshakeError::DestinationProof.into());
    }
    let mac = key.and_then(ClusterKey::block_mac).filter(|_| !sealed);
    w.secure(
        Channel::new(&s, sealed, Side::Source)
            .with_key(key.map(ClusterKey::id))
            .with_block_mac(mac.cloned()),
    );
    w.send(&PeerMsg::Ready, &[], limit).await?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(dialled: &str, ids: Vec<u64>) -> PeerMsg {
        PeerMsg::Hello {
            version: PEER_PROTOCOL_VERSION,
            node: "tcp://10.0.0.2:7000".into(),
            dialled: dialled.into(),
            nonce: vec![1; NONCE_LEN],
            key_ids: ids,
            encrypt: false,
        }
    }

    fn challenge(id: Option<u64>) -> PeerMsg {
        PeerMsg::Challenge {
            version: PEER_PROTOCOL_VERSION,
            node: "tcp://10.0.0.1:7000".into(),
            nonce: vec![2; NONCE_LEN],
            key_id: id,
            encrypt: false,
            proof: vec![0; HASH_LEN],
        }
    }

    #[test]
    fn proofs_bind_the_key_the_role_and_every_transcript_field() {
        let k = ClusterKey::from_bytes(b"0123456789abcdef");
        let th = transcript(
            &hello("tcp://10.0.0.1:7000", vec![k.id()]),
            &challenge(Some(k.id())),
        )
        .unwrap();
        let s = secret(Some(&k), &th);
        assert_ne!(source_proof(&s), dest_proof(&s));
        // Another dialled endpoint (a relay), key, or nonce: another proof.
        let relayed = transcript(
            &hello("tcp://10.0.0.9:7000", vec![k.id()]),
            &challenge(Some(k.id())),
        )
        .unwrap();
        assert_ne!(source_proof(&secret(Some(&k), &relayed)), source_proof(&s));
        let other = ClusterKey::from_bytes(b"0123456789abcdeX");
        assert_ne!(other.id(), k.id());
        assert_ne!(source_proof(&secret(Some(&other), &th)), source_proof(&s));
        let mut c = challenge(Some(k.id()));
        if let PeerMsg::Challenge { encrypt, .. } = &mut c {
            *encrypt = true;
        }
        assert_ne!(
            transcript(&hello("tcp://10.0.0.1:7000", vec![k.id()]), &c).unwrap(),
            th
        );
        // The proof field itself is not part of the transcript.
        let mut c = challenge(Some(k.id()));
        if let PeerMsg::Challenge { proof, .. } = &mut c {
            *proof = vec![9; HASH_LEN];
        }
        assert_eq!(
            transcript(&hello("tcp://10.0.0.1:7000", vec![k.id()]), &c).unwrap(),
            th
        );
        assert!(proof_ok(source_proof(&s), &source_proof(&s)));
        assert!(!proof_ok(source_proof(&s), &dest_proof(&s)));
        assert!(format!("{k:?}").contains("redacted"));
        assert!(!format!("{k:?}").contains("0123"));
    }

    #[test]
    fn key_files_hold_one_or_two_keys_and_the_ring_picks_a_common_one() {
        let dir = std::env::temp_dir().join(format!("kvnode-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("k");
        std::fs::write(&f, "old-key-0123456789\n\n  new-key-0123456789  \n").unwrap();
        let r = KeyRing::load(&f).unwrap();
        let (old, new) = (
            ClusterKey::from_bytes(b"old-key-0123456789"),
            ClusterKey::from_bytes(b"new-key-0123456789"),
        );
        assert_eq!(r.ids(), vec![old.id(), new.id()]);
        assert_eq!(r.pick(&[new.id()]).unwrap().id(), new.id());
        assert_eq!(r.pick(&[new.id(), old.id()]).unwrap().id(), old.id());
        assert!(r.pick(&[1, 2]).is_none());
        for bad in [
            "",
            "short\n",
            "a-key-0123456789\nb-key-0123456789\nc-key-0123456789\n",
            "same-key-0123456789\nsame-key-0123456789\n",
        ] {
            std::fs::write(&f, bad).unwrap();
            assert!(KeyRing::load(&f).is_err(), "{bad:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_dialled_endpoint_names_this_daemon_by_advertisement_or_by_address() {
        let me = Identity {
            node: "tcp://kv-a:7000".into(),
            advertised: Endpoint::parse("tcp://kv-a:7000").ok(),
        };
        let local: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert!(names_me("tcp://kv-a:7000", &me, local).await);
        assert!(names_me("tcp://127.0.0.1:7000", &me, local).await);
        assert!(names_me("tcp://localhost:7000", &me, local).await);
        assert!(!names_me("tcp://127.0.0.2:7000", &me, local).await);
        assert!(!names_me("tcp://127.0.0.1:7001", &me, local).await);
        assert!(!names_me("garbage", &me, local).await);
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce(), nonce());
    }
}
