//! Peer protocol messages between daemons (docs/peer-protocol.md is the normative spec).
//!
//! Frames use the client frame layout ([`crate::frame`]): an 8-byte prefix, a msgpack header
//! (one [`PeerMsg`]) and a raw payload. Only [`PeerMsg::Block`] carries a payload: the
//! block's bytes, exactly `len` of them, whose XXH3-64 is `xxh3`. On a connection that
//! negotiated UCX ([`PeerMsg::UcxRequest`]), blocks are answered by [`PeerMsg::Slot`]
//! instead: where the destination reads them with a one-sided GET.

use serde::{Deserialize, Serialize};

use crate::frame::{FrameError, FramePrefix, decode_header};
use crate::key::{Digest, NamespaceId};

/// Version of the peer protocol spoken by this build (2: UCX negotiation and `Slot` answers).
pub const PEER_PROTOCOL_VERSION: u32 = 2;
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

/// HMAC domain label of the source's proof (covers the destination's nonce, then its own).
pub const SOURCE_PROOF_LABEL: &[u8] = b"kvnode-peer-v1 source";
/// HMAC domain label of the destination's proof (covers the source's nonce, then its own).
pub const DEST_PROOF_LABEL: &[u8] = b"kvnode-peer-v1 destination";

/// One key of a pull: page digest and segment inside the pull's namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullKey(pub Digest, pub u16);

/// A peer frame header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMsg {
    /// Destination -> source, first frame: who it is and its challenge to the source.
    Hello {
        /// [`PEER_PROTOCOL_VERSION`].
        version: u32,
        /// The destination's advertised endpoint or name (logs only).
        node: String,
        /// Fresh random nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// Whether the destination holds a cluster key.
        keyed: bool,
    },
    /// Source -> destination: its own challenge and its answer to the destination's.
    Challenge {
        /// [`PEER_PROTOCOL_VERSION`].
        version: u32,
        /// The source's advertised endpoint (logs only).
        node: String,
        /// Fresh random nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// HMAC-SHA256(key, SOURCE_PROOF_LABEL || dest nonce || source nonce); empty when keyless.
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
    },
    /// Destination -> source: its answer to the source's challenge.
    Auth {
        /// HMAC-SHA256(key, DEST_PROOF_LABEL || source nonce || dest nonce); empty when keyless.
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
    },
    /// Source -> destination: key `idx` of request `req`; `len` payload bytes follow.
    Block {
        /// Request id.
        req: u64,
        /// Index into the request's keys.
        idx: u32,
        /// Payload bytes.
        len: u32,
        /// XXH3-64 of the payload.
        xxh3: u64,
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
    /// source's arena at `addr`, `len` bytes whose XXH3-64 is `xxh3`. No payload follows:
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
        /// XXH3-64 of the block.
        xxh3: u64,
    },
    /// Destination -> source (UCX connections): every GET of request `req` has completed or
    /// been given back by UCX; the source may release its leases.
    Landed {
        /// Request id.
        req: u64,
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
        PeerMsg::Slot { len, .. } if *len == 0 || *len > MAX_PEER_BLOCK => {
            return Err(PeerFrameError::Range(format!(
                "slot of {len} bytes, expected 1..={MAX_PEER_BLOCK}"
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
        PeerMsg::Pull { keys, .. } if keys.is_empty() || keys.len() > MAX_PULL_KEYS => {
            return Err(PeerFrameError::Range(format!(
                "pull of {} keys, expected 1..={MAX_PULL_KEYS}",
                keys.len()
            )));
        }
        _ => {}
    }
    Ok(msg)
}

/// Decodes one whole frame from a byte buffer: `(message, frame length)`; the payload of a
/// `Block` is `buf[frame_len - len .. frame_len]`. `Ok(None)` when `buf` is a strict prefix.
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
            xxh3: 9,
        };
        let f = frame(&m, b"hello");
        let (back, n) = decode_peer_frame(&f).unwrap().unwrap();
        assert_eq!((back, n), (m, f.len()));
        assert_eq!(decode_peer_frame(&f[..f.len() - 1]).unwrap(), None);
    }

    #[test]
    fn payload_length_must_match_the_header() {
        let m = PeerMsg::Block {
            req: 3,
            idx: 1,
            len: 4,
            xxh3: 9,
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
            xxh3: 77,
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
            xxh3: 0,
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
        };
        assert!(matches!(
            decode_peer_frame(&frame(&pull, b"")),
            Err(PeerFrameError::Range(_))
        ));
        let hello = PeerMsg::Hello {
            version: 1,
            node: "x".into(),
            nonce: vec![0; 3],
            keyed: false,
        };
        assert!(matches!(
            decode_peer_frame(&frame(&hello, b"")),
            Err(PeerFrameError::Range(_))
        ));
    }

    proptest! {
        #[test]
        fn peer_frame_decoder_never_panics_on_random_bytes(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_peer_frame(&b);
        }

        #[test]
        fn peer_frame_decoder_survives_mutated_valid_frames(
            i in 0usize..64, x in any::<u8>(), cut in 0usize..80,
        ) {
            let m = PeerMsg::Pull { req: 7, ns: NamespaceId(5), keys: vec![PullKey(Digest([1; 32]), 0)] };
            let mut f = frame(&m, b"");
            let i = i % f.len();
            f[i] ^= x;
            f.truncate(f.len().saturating_sub(cut % 8));
            let _ = decode_peer_frame(&f);
        }
    }
}
