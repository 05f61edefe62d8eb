//! The sealed peer channel: what every frame after the handshake carries, in each direction.
//!
//! A session has two halves, destination -> source and source -> destination, each with its
//! own key (derived from the cluster key and the handshake transcript, `peer::auth`) and its
//! own frame counter. Each frame is sealed under the next counter value, which is never sent:
//! a dropped, replayed, reordered or injected frame fails the next check, and so does any
//! changed byte of prefix or header.
//!
//! Every header is AES-256-GCM ciphertext (nonce = 0 || seq, associated data = the prefix)
//! followed by its 16-byte tag, in every session: headers name keys and namespaces, and on a
//! UCX connection they carry the source's worker address, remote key and slot addresses,
//! which must never cross the wire readable (an observer holding them could GET the arena).
//! The header of a `Block` carries the BLAKE3 hash of its bytes, so the header's tag makes
//! the payload authentic too: the destination hashes the body as it lands (one pass) and
//! commits only if the hash matches.
//!
//! Bodies are encrypted only in an encrypted session (`[peer] encrypt`): a `Block` body is
//! then its own AES-256-GCM message (nonce = 1 || seq) whose tag travels in the sealed
//! header (`seal`). Otherwise bodies cross in the clear, authenticated by that hash.

//!
//! AES-256-GCM is ring's (already linked for TLS): its AES-NI/VAES + carry-less-multiply
//! code seals and opens a 1 MiB body at several GB/s on one core, against under 1 GB/s for
//! the portable `aes-gcm` crate used before (docs/benchmarks.md). The construction and the
//! wire bytes are the same.

use std::sync::Arc;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, Tag, UnboundKey};

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{AEAD_TAG_LEN, PeerFrameError, PeerMsg, check_prefix, decode_peer};

use crate::peer::PeerError;
use crate::peer::error::{IntegrityCheck, WireError};
use kvnode_blockmac::BlockMac;

/// Which end of a session this daemon is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The daemon that dialled and pulls.
    Destination,
    /// The daemon that accepted and answers.
    Source,
}

/// Key-derivation contexts of the session keys (BLAKE3 `derive_key`), one per direction.
/// The session mode (bodies encrypted or not) is in the transcript, so the two modes never
/// share a key.
const D2S_AEAD: &str = "kvnode 2026-12 peer v4 destination-to-source aes-256-gcm";
const S2D_AEAD: &str = "kvnode 2026-12 peer v4 source-to-destination aes-256-gcm";

/// One direction of a session: its key and its frame counter.
pub struct Half {
    aead: LessSafeKey,
    /// Whether `Block` bodies are encrypted too (headers always are).
    bodies: bool,
    /// Sequence number of the next frame.
    seq: u64,
}

impl std::fmt::Debug for Half {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Half")
            .field("encrypted", &self.encrypts())
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

/// The nonce of frame `seq`'s header (`kind` 0) or body (`kind` 1). Each half's key seals
/// each (kind, seq) once: the counter only moves forward.
fn nonce(kind: u8, seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[0] = kind;
    n[4..].copy_from_slice(&seq.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn tag_of(bytes: &[u8]) -> Option<Tag> {
    <[u8; AEAD_TAG_LEN]>::try_from(bytes).ok().map(Tag::from)
}

fn integrity(check: IntegrityCheck) -> PeerError {
    WireError::Integrity(check).into()
}

impl Half {
    fn new(secret: &[u8], ctx: &str, encrypt: bool) -> Self {
        let k = blake3::derive_key(ctx, secret);
        let key = UnboundKey::new(&AES_256_GCM, &k).expect("a 32-byte key is an AES-256 key");
        Self {
            aead: LessSafeKey::new(key),
            bodies: encrypt,
            seq: 0,
        }
    }

    /// Whether bodies are encrypted (headers always are).
    pub fn encrypts(&self) -> bool {
        self.bodies
    }

    /// Bytes of the tag after each header.
    pub fn tag_len(&self) -> usize {
        AEAD_TAG_LEN
    }

    /// The sequence number of the next frame.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Encrypts a `Block` body in place for the frame about to be sealed; returns its tag
    /// (for the header's `seal`), or `None` when this half leaves bodies in the clear.
    pub fn seal_body(&self, body: &mut [u8]) -> Option<[u8; AEAD_TAG_LEN]> {
        if !self.bodies {
            return None;
        }
        let tag = self
            .aead
            .seal_in_place_separate_tag(nonce(1, self.seq), Aad::empty(), body)
            .expect("a block is far below the AES-GCM message limit");
        let mut t = [0u8; AEAD_TAG_LEN];
        t.copy_from_slice(tag.as_ref());
        Some(t)
    }

    /// Encodes and seals `msg` (announcing `payload_len` body bytes) as the next frame:
    /// prefix, header, tag. The body follows unchanged (or as sealed by [`Half::seal_body`]).
    pub fn seal(&mut self, msg: &PeerMsg, payload_len: u64) -> Result<Vec<u8>, PeerError> {
        let f = encode_frame(msg, payload_len).map_err(WireError::Encode)?;
        Ok(self.seal_encoded(f))
    }

    /// Seals an encoded frame head (prefix + header bytes, whatever they hold) as the next
    /// frame. Only [`Half::seal`] and tests of a key holder sending garbage use it.
    pub fn seal_encoded(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        let (prefix, header) = f.split_at_mut(PREFIX_LEN);
        let t = self
            .aead
            .seal_in_place_separate_tag(nonce(0, self.seq), Aad::from(&*prefix), header)
            .expect("a header is far below the AES-GCM message limit");
        f.extend_from_slice(t.as_ref());
        self.seq += 1;
        f
    }

    /// Checks and opens the next frame: `prefix` as received, `header` (decrypted in place)
    /// and its `tag`. Returns the message and the sequence number it was sealed under.
    pub fn open(
        &mut self,
        prefix: &[u8; PREFIX_LEN],
        header: &mut [u8],
        tag: &[u8],
    ) -> Result<(PeerMsg, u64), PeerError> {
        let p = FramePrefix::decode(*prefix)
            .map_err(|e| PeerError::from(PeerFrameError::from(e)))
            .and_then(|p| check_prefix(p).map_err(PeerError::from))?;
        let seq = self.seq;
        let t = tag_of(tag).ok_or_else(|| integrity(IntegrityCheck::ShortTag))?;
        // The GCM tag is checked (in constant time) before the plaintext is used.
        self.aead
            .open_in_place_separate_tag(nonce(0, seq), Aad::from(prefix), t, header, 0..)
            .map_err(|_| integrity(IntegrityCheck::Frame))?;
        self.seq += 1;
        Ok((decode_peer(p, header)?, seq))
    }

    /// Decrypts a `Block` body in place, received in the frame sealed under `seq`, against the
    /// tag from its header. Halves that leave bodies in the clear leave `body` alone.
    pub fn open_body(&self, seq: u64, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        if !self.bodies {
            return Ok(());
        }
        let t = tag_of(seal).ok_or_else(|| integrity(IntegrityCheck::BodyTagMissing))?;
        self.aead
            .open_in_place_separate_tag(nonce(1, seq), Aad::empty(), t, body, 0..)
            .map(|_| ())
            .map_err(|_| integrity(IntegrityCheck::Body))
    }
}

/// Both halves of an established session, as seen from one side.
#[derive(Debug)]
pub struct Channel {
    /// Frames this side sends.
    pub send: Half,
    /// Frames this side receives.
    pub recv: Half,
    /// Id of the cluster key the session was derived from (`None`: keyless). A session whose
    /// key was removed from the key file is closed at its next request.
    pub key_id: Option<u64>,
    /// The block MAC of a keyed plaintext session, where this CPU computes it fast
    /// (`kvnode_blockmac`); `None`: blocks are verified by BLAKE3 only.
    pub block_mac: Option<Arc<BlockMac>>,
}

impl Channel {
    /// The session keys from `secret` (cluster key and transcript, see `peer::auth`).
    pub fn new(secret: &[u8], encrypt: bool, side: Side) -> Self {
        let d2s = Half::new(secret, D2S_AEAD, encrypt);
        let s2d = Half::new(secret, S2D_AEAD, encrypt);
        let (send, recv) = match side {
            Side::Destination => (d2s, s2d),
            Side::Source => (s2d, d2s),
        };
        Self {
            send,
            recv,
            key_id: None,
            block_mac: None,
        }
    }

    /// Records the session's key id.
    #[must_use]
    pub fn with_key(mut self, id: Option<u64>) -> Self {
        self.key_id = id;
        self
    }

    /// Sets the block MAC (keyed plaintext sessions only).
    #[must_use]
    pub fn with_block_mac(mut self, mac: Option<Arc<BlockMac>>) -> Self {
        self.block_mac = mac;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvnode_proto::peer::HASH_LEN;

    fn open_frame(h: &mut Half, f: &[u8]) -> Result<PeerMsg, PeerError> {
        let mut prefix = [0u8; PREFIX_LEN];
        prefix.copy_from_slice(&f[..PREFIX_LEN]);
        let t = f.len() - h.tag_len();
        let mut header = f[PREFIX_LEN..t].to_vec();
        h.open(&prefix, &mut header, &f[t..]).map(|(m, _)| m)
    }

    #[test]
    fn every_frame_is_bound_to_its_key_direction_and_place_in_the_sequence() {
        for encrypt in [false, true] {
            let mut d = Channel::new(b"secret", encrypt, Side::Destination);
            let mut s = Channel::new(b"secret", encrypt, Side::Source);
            let f0 = d.send.seal(&PeerMsg::Ping { t: 1 }, 0).unwrap();
            let f1 = d.send.seal(&PeerMsg::Ping { t: 2 }, 0).unwrap();
            // Reordered: the second frame first fails.
            let mut r = Channel::new(b"secret", encrypt, Side::Source);
            assert!(matches!(
                open_frame(&mut r.recv, &f1),
                Err(PeerError::Wire(WireError::Integrity(_)))
            ));
            // Reflected back to its sender: the other direction's key.
            assert!(open_frame(&mut d.recv, &f0).is_err());
            // Another key.
            let mut other = Channel::new(b"secreT", encrypt, Side::Source);
            assert!(open_frame(&mut other.recv, &f0).is_err());
            // Any flipped byte.
            for i in 0..f0.len() {
                let mut bad = f0.clone();
                bad[i] ^= 0x10;
                let mut r = Channel::new(b"secret", encrypt, Side::Source);
                assert!(open_frame(&mut r.recv, &bad).is_err(), "byte {i}");
            }
            assert_eq!(
                open_frame(&mut s.recv, &f0).unwrap(),
                PeerMsg::Ping { t: 1 }
            );
            assert_eq!(
                open_frame(&mut s.recv, &f1).unwrap(),
                PeerMsg::Ping { t: 2 }
            );
            // Replayed: the counter moved on.
            assert!(open_frame(&mut s.recv, &f1).is_err());
            // Headers are ciphertext in both modes.
            assert!(!f0.windows(4).any(|w| w == b"Ping"), "readable header");
        }
    }

    #[test]
    fn encrypted_bodies_hide_the_bytes_and_refuse_any_change() {
        let mut s = Channel::new(b"k", true, Side::Source);
        let d = Channel::new(b"k", true, Side::Destination);
        let plain = vec![0x5au8; 4096];
        let mut body = plain.clone();
        let seq = s.send.seq();
        let seal = s.send.seal_body(&mut body).unwrap();
        assert!(!body.windows(64).any(|w| w == &plain[..64]));
        let _ = s.send.seal(
            &PeerMsg::Block {
                req: 1,
                idx: 0,
                len: 4096,
                hash: vec![0; HASH_LEN],
                seal: seal.to_vec(),
                meta: None,
            },
            4096,
        );
        let mut bad = body.clone();
        bad[100] ^= 1;
        assert!(d.recv.open_body(seq, &mut bad, &seal).is_err());
        assert!(d.recv.open_body(seq + 1, &mut body.clone(), &seal).is_err());
        d.recv.open_body(seq, &mut body, &seal).unwrap();
        assert_eq!(body, plain);
    }

    #[test]
    fn ucx_offers_and_slots_are_unreadable_on_the_wire_without_body_encryption() {
        let mut s = Channel::new(b"k", false, Side::Source);
        let mut d = Channel::new(b"k", false, Side::Destination);
        let worker = vec![0xa7u8; 200];
        let rkey = vec![0x3cu8; 90];
        let base = 0x7f12_3456_7000_u64;
        let offer = PeerMsg::UcxOffer {
            worker: worker.clone(),
            rkey: rkey.clone(),
            base,
            len: 1 << 30,
        };
        let slot = PeerMsg::Slot {
            req: 1,
            idx: 0,
            len: 4096,
            addr: base + 8192,
            hash: vec![0x11; HASH_LEN],
            seal: Vec::new(),
            meta: None,
        };
        for m in [offer, slot] {
            let f = s.send.seal(&m, 0).unwrap();
            let h = &f[PREFIX_LEN..];
            assert!(!h.windows(8).any(|w| w == &worker[..8]), "worker address");
            assert!(!h.windows(8).any(|w| w == &rkey[..8]), "rkey");
            for a in [base, base + 8192] {
                for enc in [a.to_be_bytes(), a.to_le_bytes()] {
                    assert!(!h.windows(8).any(|w| w == enc), "address {a:#x}");
                }
            }
            assert!(
                decode_peer(
                    FramePrefix::decode(f[..PREFIX_LEN].try_into().unwrap()).unwrap(),
                    &f[PREFIX_LEN..f.len() - AEAD_TAG_LEN]
                )
                .is_err()
            );
            assert_eq!(open_frame(&mut d.recv, &f).unwrap(), m);
        }
    }
}
