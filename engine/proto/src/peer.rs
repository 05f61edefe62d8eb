//! Peer protocol messages between daemons (docs/peer-protocol.md is the normative spec).
//!
//! Frames use the client frame layout ([`crate::frame`]): an 8-byte prefix, a msgpack header
//! (one [`PeerMsg`]) and a raw payload. The handshake (`Hello`, `Challenge`, `Auth`, and a
//! `Refused` before `Ready`) travels as plain frames; every later frame is sealed by the
//! session (engine/core `peer::transport::channel`): the header is AES-256-GCM ciphertext
//! and its tag of [`AEAD_TAG_LEN`] bytes follows it (bodies are encrypted too only in an
//! encrypted session). Only [`PeerMsg::Block`] carries a
//! payload: the block's bytes, exactly `len` of them, whose BLAKE3 hash is `hash`.
//! On a connection that negotiated UCX ([`PeerMsg::UcxRequest`], sealed like every frame
//! after the handshake), blocks are answered by [`PeerMsg::Slot`] instead: where the
//! destination reads them with a one-sided GET, and their BLAKE3 hash.

use serde::{Deserialize, Serialize};

use crate::frame::{FrameError, FramePrefix, decode_header};
use crate::key::{Digest, NamespaceId};
use crate::namespace::MAX_PAGE_SIZE;

/// Version of the peer protocol spoken by this build (2: sealed channel; 3: UCX
/// negotiation and `Slot` answers; 4: every sealed header encrypted, so UCX offers and
/// slot addresses never cross the wire readable).
pub const PEER_PROTOCOL_VERSION: u32 = 4;
/// Largest UCX worker address or packed remote key a peer may send.
pub const MAX_UCX_BLOB: usize = 64 << 10;
/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Most keys one `Pull` may name.
pub const MAX_PULL_KEYS: usize = 4096;
/// Largest header a peer frame may carry (much smaller than the client limit: a pull of
/// `MAX_PULL_KEYS` keys fits in ~200 KiB).
pub const MAX_PEER_HEADER: u32 = 1 << 20;
/// Largest block a peer may send.
pub const MAX_PEER_BLOCK: u32 = 256 << 20;

/// Bytes of a handshake proof and of a block's content hash (BLAKE3 output).
pub const HASH_LEN: usize = 32;
/// Bytes of an AES-256-GCM tag (after every sealed header, and of each block body of an
/// encrypted session).
pub const AEAD_TAG_LEN: usize = 16;
/// Most cluster keys a daemon accepts at once (the current one and the next, during a roll).
pub const MAX_KEY_IDS: usize = 2;

/// One key of a pull: page digest and segment inside the pull's namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullKey(pub Digest, pub u16);

/// The source's router metadata of one pulled block (the fields of its KV event), sent
/// when the destination asked for it (`Pull { meta: true }`) and the source announced the
/// block, so the destination can announce the block it now holds (docs/peer-protocol.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerMeta {
    /// Exact tokens of the block (at most [`MAX_PAGE_SIZE`]; the destination announces the
    /// block only when their count is its namespace's page size).
    pub tokens: Vec<u32>,
    /// Router hash of the parent block, `None` for a chain root.
    pub parent: Option<u64>,
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_false(b: &bool) -> bool {
    !*b
}

/// A peer frame header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMsg {
    /// Destination -> source, first frame: who it is, whom it dialled, its challenge.
    Hello {
        /// [`PEER_PROTOCOL_VERSION`].
        version: u32,
        /// The destination's own identity (its advertised endpoint, or a name).
        node: String,
        /// The endpoint the destination dialled (`tcp://host:port`, from the hint): the
        /// source refuses a `Hello` that does not name it, and both proofs cover it.
        dialled: String,
        /// Fresh random nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// Ids of the cluster keys the destination holds (at most [`MAX_KEY_IDS`]; empty:
        /// keyless). An id is a fingerprint of a key, never the key.
        key_ids: Vec<u64>,
        /// Whether the destination requires an encrypted session.
        encrypt: bool,
    },
    /// Source -> destination: its identity and challenge, the session it picked, its proof.
    Challenge {
        /// [`PEER_PROTOCOL_VERSION`].
        version: u32,
        /// The source's advertised identity.
        node: String,
        /// Fresh random nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// The key both proofs use (one the destination offered); `None`: keyless.
        key_id: Option<u64>,
        /// Whether the session is encrypted (either side asked for it).
        encrypt: bool,
        /// The source's proof over the transcript ([`HASH_LEN`] bytes).
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
    },
    /// Destination -> source: its proof over the transcript.
    Auth {
        /// [`HASH_LEN`] bytes.
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
    },
    /// Source -> destination: authenticated; pulls may follow.
    Ready,
    /// Either side: the connection is refused or broken; the sender closes after it.
    Refused {
        /// Why, for the other side's log.
        reason: String,
    },
    /// Destination -> source: send these blocks, in order.
    Pull {
        /// Request id, echoed by every answer.
        req: u64,
        /// Namespace identity (both daemons derive it from the same spec).
        ns: NamespaceId,
        /// Keys, at most [`MAX_PULL_KEYS`].
        keys: Vec<PullKey>,
        /// Send each block's router metadata ([`PeerMeta`]) with it, where the source has
        /// it. Absent (false) from a destination that announces no KV events, and from
        /// older destinations.
        #[serde(default, skip_serializing_if = "is_false")]
        meta: bool,
    },
    /// Source -> destination: key `idx` of request `req`; `len` payload bytes follow.
    Block {
        /// Request id.
        req: u64,
        /// Index into the request's keys.
        idx: u32,
        /// Payload bytes.
        len: u32,
        /// BLAKE3 hash of the block's bytes ([`HASH_LEN`]); the sealed header makes it
        /// authentic, so bytes that hash to it are the source's.
        #[serde(with = "serde_bytes")]
        hash: Vec<u8>,
        /// In an encrypted session, the AES-256-GCM tag of the encrypted payload
        /// ([`AEAD_TAG_LEN`]). In a keyed plaintext session, the block MAC (POLYVAL of the
        /// bytes under a key derived from the cluster key, 16 bytes) when the source
        /// computes one, which a destination that can may check instead of hashing; else
        /// empty. Ignored by a destination that does not check it (it hashes).
        #[serde(with = "serde_bytes")]
        seal: Vec<u8>,
        /// The block's router metadata, when the pull asked for it and the source has it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        meta: Option<PeerMeta>,
    },
    /// Source -> destination: key `idx` is not held.
    Miss {
        /// Request id.
        req: u64,
        /// Index into the request's keys.
        idx: u32,
    },
    /// Source -> destination: every key of `req` has been answered.
    Done {
        /// Request id.
        req: u64,
    },
    /// Destination -> source, after `Ready`, before any `Pull`: answer blocks as [`PeerMsg::Slot`]s
    /// that this destination reads with UCX GETs. Answered by `UcxOffer` or `UcxDecline`.
    UcxRequest,
    /// Source -> destination: how to read its arena. Sent only after authentication; the
    /// worker address and the key are secrets of the connection (never logged).
    UcxOffer {
        /// The source's UCX worker address.
        #[serde(with = "serde_bytes")]
        worker: Vec<u8>,
        /// The packed remote key of the source's registered arena.
        #[serde(with = "serde_bytes")]
        rkey: Vec<u8>,
        /// First address of the registered arena (every `Slot` lies inside it).
        base: u64,
        /// Registered bytes.
        len: u64,
    },
    /// Source -> destination: no UCX here; the connection goes on as plain TCP.
    UcxDecline {
        /// Why, for the destination's log.
        reason: String,
    },
    /// Source -> destination (UCX connections): key `idx` of request `req` is leased in the
    /// source's arena at `addr`, `len` bytes whose BLAKE3 hash is `hash`. No payload follows:
    /// the destination GETs the bytes. The lease holds until `Landed { req }`.
    Slot {
        /// Request id.
        req: u64,
        /// Index into the request's keys.
        idx: u32,
        /// Block bytes.
        len: u32,
        /// Address of the block in the source's registered arena.
        addr: u64,
        /// BLAKE3 hash of the block ([`HASH_LEN`] bytes), computed once at the source; the
        /// sealed header makes it authentic, so landed bytes that hash to it are the source's.
        #[serde(with = "serde_bytes")]
        hash: Vec<u8>,
        /// In a keyed plaintext session, the block MAC of the bytes (16 bytes, as a `Block`'s
        /// `seal`) when the source computes one: a destination that can checks the landed
        /// bytes against it instead of hashing them. Else empty.
        #[serde(default, with = "serde_bytes")]
        seal: Vec<u8>,
        /// The block's router metadata, as in [`PeerMsg::Block`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        meta: Option<PeerMeta>,
    },
    /// Destination -> source (UCX connections): every GET of request `req` has completed or
    /// been given back by UCX; the source may release its leases.
    Landed {
        /// Request id.
        req: u64,
    },
    /// Destination -> source, after `Ready`: which pages of namespace `ns` the source holds
    /// under these router hashes (the ones its KV events announced). Answered by `Resolved`.
    /// Lets a destination that knows blocks only as a router does (by hash) pull them.
    Resolve {
        /// Request id, echoed by the answer.
        req: u64,
        /// Namespace identity.
        ns: NamespaceId,
        /// Router hashes, at most [`MAX_PULL_KEYS`].
        hashes: Vec<u64>,
    },
    /// Source -> destination: one entry per hash of `Resolve { req }`, in its order: the
    /// page digest the source announced under that hash in that namespace, or `None`.
    Resolved {
        /// Request id.
        req: u64,
        /// Page digests.
        digests: Vec<Option<Digest>>,
    },
    /// Either side: liveness probe.
    Ping {
        /// Echoed.
        t: u64,
    },
    /// Either side: answer to `Ping`.
    Pong {
        /// Echoed.
        t: u64,
    },
}

/// A peer frame that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerFrameError {
    /// Prefix or header undecodable.
    #[error("peer frame: {0}")]
    Frame(#[from] FrameError),
    /// Header too large for the peer protocol.
    #[error("peer frame header of {0} bytes exceeds {MAX_PEER_HEADER}")]
    HeaderTooLarge(u32),
    /// A payload on a message that carries none, or a `Block` whose length disagrees.
    #[error("peer frame payload of {payload} bytes does not match its {msg} header")]
    PayloadMismatch {
        /// Message kind.
        msg: &'static str,
        /// Payload length in the prefix.
        payload: u32,
    },
    /// A field out of range.
    #[error("peer frame field out of range: {0}")]
    Range(String),
}

/// Validates a decoded prefix for the peer protocol.
pub fn check_prefix(p: FramePrefix) -> Result<FramePrefix, PeerFrameError> {
    if p.header_len > MAX_PEER_HEADER {
        return Err(PeerFrameError::HeaderTooLarge(p.header_len));
    }
    if p.payload_len > MAX_PEER_BLOCK {
        return Err(PeerFrameError::Range(format!(
            "payload {} exceeds the {MAX_PEER_BLOCK}-byte block limit",
            p.payload_len
        )));
    }
    Ok(p)
}

/// Decodes a header and checks it against the prefix's payload length.
pub fn decode_peer(prefix: FramePrefix, header: &[u8]) -> Result<PeerMsg, PeerFrameError> {
    let msg: PeerMsg = decode_header(header)?;
    let bad = |m| PeerFrameError::PayloadMismatch {
        msg: m,
        payload: prefix.payload_len,
    };
    match &msg {
        PeerMsg::Block { len, .. } if *len != prefix.payload_len => return Err(bad("Block")),
        PeerMsg::Block { hash, seal, .. }
            if hash.len() != HASH_LEN || !(seal.is_empty() || seal.len() == AEAD_TAG_LEN) =>
        {
            return Err(PeerFrameError::Range(format!(
                "block hash of {} bytes and seal of {} (expected {HASH_LEN} and 0 or {AEAD_TAG_LEN})",
                hash.len(),
                seal.len()
            )));
        }
        PeerMsg::Block { meta: Some(m), .. } | PeerMsg::Slot { meta: Some(m), .. }
            if m.tokens.len() > MAX_PAGE_SIZE as usize =>
        {
            return Err(PeerFrameError::Range(format!(
                "block metadata of {} tokens, at most {MAX_PAGE_SIZE}",
                m.tokens.len()
            )));
        }
        PeerMsg::Block { .. } => {}
        _ if prefix.payload_len != 0 => return Err(bad("non-Block")),
        PeerMsg::Hello { nonce, .. } | PeerMsg::Challenge { nonce, .. }
            if nonce.len() != NONCE_LEN =>
        {
            return Err(PeerFrameError::Range(format!(
                "nonce of {} bytes, expected {NONCE_LEN}",
                nonce.len()
            )));
        }
        PeerMsg::Slot {
            len, hash, seal, ..
        } if *len == 0
            || *len > MAX_PEER_BLOCK
            || hash.len() != HASH_LEN
            || !(seal.is_empty() || seal.len() == AEAD_TAG_LEN) =>
        {
            return Err(PeerFrameError::Range(format!(
                "slot of {len} bytes with a {}-byte hash and a {}-byte seal, expected 1..={MAX_PEER_BLOCK}, {HASH_LEN} and 0 or {AEAD_TAG_LEN}",
                hash.len(),
                seal.len()
            )));
        }
        PeerMsg::UcxOffer { worker, rkey, .. }
            if worker.len() > MAX_UCX_BLOB || rkey.len() > MAX_UCX_BLOB =>
        {
            return Err(PeerFrameError::Range(format!(
                "UCX offer of {} + {} bytes, each at most {MAX_UCX_BLOB}",
                worker.len(),
                rkey.len()
            )));
        }
        PeerMsg::Hello { key_ids, .. } if key_ids.len() > MAX_KEY_IDS => {
            return Err(PeerFrameError::Range(format!(
                "{} key ids, at most {MAX_KEY_IDS}",
                key_ids.len()
            )));
        }
        PeerMsg::Challenge { proof, .. } | PeerMsg::Auth { proof } if proof.len() != HASH_LEN => {
            return Err(PeerFrameError::Range(format!(
                "proof of {} bytes, expected {HASH_LEN}",
                proof.len()
            )));
        }
        PeerMsg::Pull { keys, .. } if keys.is_empty() || keys.len() > MAX_PULL_KEYS => {
            return Err(PeerFrameError::Range(format!(
                "pull of {} keys, expected 1..={MAX_PULL_KEYS}",
                keys.len()
            )));
        }
        PeerMsg::Resolve { hashes, .. } if hashes.is_empty() || hashes.len() > MAX_PULL_KEYS => {
            return Err(PeerFrameError::Range(format!(
                "resolve of {} hashes, expected 1..={MAX_PULL_KEYS}",
                hashes.len()
            )));
        }
        PeerMsg::Resolved { digests, .. } if digests.len() > MAX_PULL_KEYS => {
            return Err(PeerFrameError::Range(format!(
                "resolve answer of {} digests, at most {MAX_PULL_KEYS}",
                digests.len()
            )));
        }
        _ => {}
    }
    Ok(msg)
}

/// Decodes one whole plain (handshake) frame from a byte buffer: `(message, frame length)`;
/// the payload of a `Block` is `buf[frame_len - len .. frame_len]`. `Ok(None)` when `buf` is
/// a strict prefix. Sealed frames carry a tag after the header and are opened by the session.
pub fn decode_peer_frame(buf: &[u8]) -> Result<Option<(PeerMsg, usize)>, PeerFrameError> {
    use crate::frame::PREFIX_LEN;
    let Some(p) = buf.get(..PREFIX_LEN) else {
        return Ok(None);
    };
    let prefix = check_prefix(FramePrefix::decode(p.try_into().expect("8 bytes"))?)?;
    let h_end = PREFIX_LEN + prefix.header_len as usize;
    let end = h_end + prefix.payload_len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    Ok(Some((decode_peer(prefix, &buf[PREFIX_LEN..h_end])?, end)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::encode_frame;
    use proptest::prelude::*;

    fn frame(m: &PeerMsg, payload: &[u8]) -> Vec<u8> {
        let mut f = encode_frame(m, payload.len() as u64).unwrap();
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn block_frame_round_trips_with_its_payload() {
        let m = PeerMsg::Block {
            req: 3,
            idx: 1,
            len: 5,
            hash: vec![9; HASH_LEN],
            seal: vec![],
            meta: None,
        };
        let f = frame(&m, b"hello");
        let (back, n) = decode_peer_frame(&f).unwrap().unwrap();
        assert_eq!((back, n), (m, f.len()));
        assert_eq!(decode_peer_frame(&f[..f.len() - 1]).unwrap(), None);
    }

    #[test]
    fn block_metadata_round_trips_and_is_bounded() {
        let meta = PeerMeta {
            tokens: (0..16).collect(),
            parent: Some(42),
        };
        let b = PeerMsg::Block {
            req: 3,
            idx: 0,
            len: 2,
            hash: vec![9; HASH_LEN],
            seal: vec![],
            meta: Some(meta.clone()),
        };
        let f = frame(&b, b"hi");
        assert_eq!(decode_peer_frame(&f).unwrap(), Some((b, f.len())));
        let too_many = PeerMeta {
            tokens: vec![1; MAX_PAGE_SIZE as usize + 1],
            parent: None,
        };
        let s = PeerMsg::Slot {
            req: 1,
            idx: 0,
            len: 1,
            addr: 0,
            hash: vec![1; HASH_LEN],
            seal: vec![],
            meta: Some(too_many),
        };
        assert!(matches!(
            decode_peer_frame(&frame(&s, b"")),
            Err(PeerFrameError::Range(m)) if m.contains("metadata")
        ));
    }

    /// Frames of peers from before block metadata (no `meta` field) decode, as `None` and
    /// `false`; a frame with it decodes in a peer that ignores it (serde skips unknown
    /// fields of the named encoding), so mixed versions interoperate in a rolling update.
    #[test]
    fn frames_without_metadata_fields_still_decode() {
        #[derive(Serialize)]
        enum OldMsg {
            Pull {
                req: u64,
                ns: NamespaceId,
                keys: Vec<PullKey>,
            },
        }
        #[derive(Deserialize, Debug)]
        enum OldBack {
            Pull { req: u64 },
        }
        let old = OldMsg::Pull {
            req: 5,
            ns: NamespaceId(2),
            keys: vec![PullKey(Digest([3; 32]), 1)],
        };
        let f = encode_frame(&old, 0).unwrap();
        let (m, _) = decode_peer_frame(&f).unwrap().unwrap();
        assert!(matches!(
            m,
            PeerMsg::Pull {
                req: 5,
                meta: false,
                ..
            }
        ));
        let new = PeerMsg::Pull {
            req: 5,
            ns: NamespaceId(2),
            keys: vec![PullKey(Digest([3; 32]), 1)],
            meta: true,
        };
        let f = encode_frame(&new, 0).unwrap();
        let prefix =
            FramePrefix::decode(f[..crate::frame::PREFIX_LEN].try_into().unwrap()).unwrap();
        let body = &f[crate::frame::PREFIX_LEN..][..prefix.header_len as usize];
        let back: OldBack = decode_header(body).unwrap();
        assert!(matches!(back, OldBack::Pull { req: 5 }));
    }

    #[test]
    fn payload_length_must_match_the_header() {
        let m = PeerMsg::Block {
            req: 3,
            idx: 1,
            len: 4,
            hash: vec![9; HASH_LEN],
            seal: vec![],
            meta: None,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&m, b"hello")),
            Err(PeerFrameError::PayloadMismatch { .. })
        ));
        assert!(matches!(
            decode_peer_frame(&frame(&PeerMsg::Ready, b"x")),
            Err(PeerFrameError::PayloadMismatch { .. })
        ));
    }

    #[test]
    fn ucx_messages_round_trip_and_carry_no_payload() {
        let offer = PeerMsg::UcxOffer {
            worker: vec![1; 40],
            rkey: vec![2; 20],
            base: 1 << 40,
            len: 1 << 30,
        };
        let slot = PeerMsg::Slot {
            req: 4,
            idx: 2,
            len: 4096,
            addr: (1 << 40) + 8192,
            hash: vec![7; HASH_LEN],
            seal: vec![9; AEAD_TAG_LEN],
            meta: None,
        };
        for m in [offer, slot, PeerMsg::UcxRequest, PeerMsg::Landed { req: 4 }] {
            let f = frame(&m, b"");
            assert_eq!(decode_peer_frame(&f).unwrap().unwrap().0, m);
            assert!(matches!(
                decode_peer_frame(&frame(&m, b"x")),
                Err(PeerFrameError::PayloadMismatch { .. })
            ));
        }
        let empty = PeerMsg::Slot {
            req: 1,
            idx: 0,
            len: 0,
            addr: 0,
            hash: vec![0; HASH_LEN],
            seal: Vec::new(),
            meta: None,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&empty, b"")),
            Err(PeerFrameError::Range(_))
        ));
    }

    #[test]
    fn empty_pulls_and_short_nonces_are_refused() {
        let pull = PeerMsg::Pull {
            req: 1,
            ns: NamespaceId(1),
            keys: vec![],
            meta: false,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&pull, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let hello = PeerMsg::Hello {
            version: 2,
            node: "x".into(),
            dialled: "tcp://h:1".into(),
            nonce: vec![0; 3],
            key_ids: vec![],
            encrypt: false,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&hello, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let short_proof = PeerMsg::Auth { proof: vec![1; 8] };
        assert!(matches!(
            decode_peer_frame(&frame(&short_proof, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let short_hash = PeerMsg::Block {
            req: 1,
            idx: 0,
            len: 1,
            hash: vec![1; 8],
            seal: vec![],
            meta: None,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&short_hash, b"x")),
            Err(PeerFrameError::Range(_))
        ));
    }

    #[test]
    fn resolves_are_bounded_and_round_trip() {
        let empty = PeerMsg::Resolve {
            req: 1,
            ns: NamespaceId(1),
            hashes: vec![],
        };
        assert!(matches!(
            decode_peer_frame(&frame(&empty, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let many = PeerMsg::Resolved {
            req: 1,
            digests: vec![None; MAX_PULL_KEYS + 1],
        };
        assert!(matches!(
            decode_peer_frame(&frame(&many, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let full = PeerMsg::Resolved {
            req: 9,
            digests: vec![Some(Digest([7; 32])); MAX_PULL_KEYS],
        };
        let f = frame(&full, b"");
        assert_eq!(decode_peer_frame(&f).unwrap(), Some((full, f.len())));
    }

    proptest! {
        #[test]
        fn resolve_frames_decode_to_what_was_sent_or_are_refused(
            hashes in proptest::collection::vec(any::<u64>(), 0..64),
            digests in proptest::collection::vec(proptest::option::of(any::<[u8; 32]>()), 0..64),
            i in 0usize..256, x in any::<u8>(),
        ) {
            let r = PeerMsg::Resolve { req: 3, ns: NamespaceId(11), hashes: hashes.clone() };
            let f = frame(&r, b"");
            match decode_peer_frame(&f) {
                Ok(Some((m, _))) => prop_assert_eq!(m, r),
                other => prop_assert!(hashes.is_empty() && matches!(other, Err(PeerFrameError::Range(_)))),
            }
            let a = PeerMsg::Resolved { req: 4, digests: digests.into_iter().map(|d| d.map(Digest)).collect() };
            let mut f = frame(&a, b"");
            prop_assert_eq!(decode_peer_frame(&f).unwrap().map(|p| p.0), Some(a));
            let i = i % f.len();
            f[i] ^= x;
            let _ = decode_peer_frame(&f);
        }

        #[test]
        fn block_frames_with_metadata_decode_to_what_was_sent_or_are_refused(
            tokens in proptest::collection::vec(any::<u32>(), 0..64),
            parent in proptest::option::of(any::<u64>()),
            i in 0usize..512, x in any::<u8>(),
        ) {
            let b = PeerMsg::Block {
                req: 8, idx: 2, len: 3, hash: vec![5; HASH_LEN], seal: vec![],
                meta: Some(PeerMeta { tokens, parent }),
            };
            let mut f = frame(&b, b"abc");
            prop_assert_eq!(decode_peer_frame(&f).unwrap().map(|p| p.0), Some(b));
            let i = i % f.len();
            f[i] ^= x;
            let _ = decode_peer_frame(&f);
        }

        #[test]
        fn peer_frame_decoder_never_panics_on_random_bytes(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_peer_frame(&b);
        }

        #[test]
        fn peer_frame_decoder_survives_mutated_valid_frames(
            i in 0usize..64, x in any::<u8>(), cut in 0usize..80,
        ) {
            let m = PeerMsg::Pull { req: 7, ns: NamespaceId(5), keys: vec![PullKey(Digest([1; 32]), 0)], meta: true };
            let mut f = frame(&m, b"");
            let i = i % f.len();
            f[i] ^= x;
            f.truncate(f.len().saturating_sub(cut % 8));
            let _ = decode_peer_frame(&f);
        }
    }
}
