//! The sealed peer channel: what every frame after the handshake carries, in each direction.
//!
//! A session has two halves, destination -> source and source -> destination, each with its
//! own keys (derived from the cluster key and the handshake transcript, `peer::auth`) and its
//! own frame counter. Each frame is sealed under the next counter value, which is never sent:
//! a dropped, replayed, reordered or injected frame fails the next check, and so does any
//! changed byte of prefix or header.
//!
//! - Authentication only (default): `prefix | header | tag`, tag = BLAKE3-keyed(mac key,
//!   le64 seq || prefix || header). The header of a `Block` carries the BLAKE3 hash of its
//!   bytes, so the tag makes the payload authentic too: the destination hashes the body as it
//!   lands (one pass) and commits only if the hash matches.
//! - Encrypted (`[peer] encrypt`): the header is AES-256-GCM ciphertext (nonce = 0 || seq,
//!   associated data = prefix) followed by its 16-byte tag; a `Block` body is encrypted as
//!   its own message (nonce = 1 || seq) whose tag travels in the sealed header (`seal`).

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit, Tag};

type Nonce = aes_gcm::aead::Nonce<Aes256Gcm>;
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{AEAD_TAG_LEN, MAC_TAG_LEN, PeerMsg, check_prefix, decode_peer};

use crate::peer::PeerError;

/// Which end of a session this daemon is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The daemon that dialled and pulls.
    Destination,
    /// The daemon that accepted and answers.
    Source,
}

/// Key-derivation contexts of the session keys (BLAKE3 `derive_key`).
const D2S_MAC: &str = "kvnode 2026-12 peer v2 destination-to-source frame mac";
const S2D_MAC: &str = "kvnode 2026-12 peer v2 source-to-destination frame mac";
const D2S_AEAD: &str = "kvnode 2026-12 peer v2 destination-to-source aes-256-gcm";
const S2D_AEAD: &str = "kvnode 2026-12 peer v2 source-to-destination aes-256-gcm";

enum Protect {
    Mac([u8; 32]),
    Aead(Box<Aes256Gcm>),
}

/// One direction of a session: its key and its frame counter.
pub struct Half {
    protect: Protect,
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

fn nonce(kind: u8, seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[0] = kind;
    n[4..].copy_from_slice(&seq.to_le_bytes());
    n.into()
}

fn integrity(what: &str) -> PeerError {
    PeerError::Integrity(what.to_owned())
}

impl Half {
    fn new(secret: &[u8], mac_ctx: &str, aead_ctx: &str, encrypt: bool) -> Self {
        let protect = if encrypt {
            let k = blake3::derive_key(aead_ctx, secret);
            Protect::Aead(Box::new(Aes256Gcm::new(&k.into())))
        } else {
            Protect::Mac(blake3::derive_key(mac_ctx, secret))
        };
        Self { protect, seq: 0 }
    }

    /// Whether bodies are encrypted.
    pub fn encrypts(&self) -> bool {
        matches!(self.protect, Protect::Aead(_))
    }

    /// Bytes of the tag after each header.
    pub fn tag_len(&self) -> usize {
        match self.protect {
            Protect::Mac(_) => MAC_TAG_LEN,
            Protect::Aead(_) => AEAD_TAG_LEN,
        }
    }

    /// The sequence number of the next frame.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    fn mac(k: &[u8; 32], seq: u64, prefix: &[u8], header: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(k);
        h.update(&seq.to_le_bytes());
        h.update(prefix);
        h.update(header);
        h.finalize()
    }

    /// Encrypts a `Block` body in place for the frame about to be sealed; returns its tag
    /// (for the header's `seal`), or `None` when this half only authenticates.
    pub fn seal_body(&self, body: &mut [u8]) -> Option<[u8; AEAD_TAG_LEN]> {
        let Protect::Aead(c) = &self.protect else {
            return None;
        };
        let tag = c
            .encrypt_in_place_detached(&nonce(1, self.seq), &[], body)
            .expect("a block is far below the AES-GCM message limit");
        Some(tag.into())
    }

    /// Encodes and seals `msg` (announcing `payload_len` body bytes) as the next frame:
    /// prefix, header, tag. The body follows unchanged (or as sealed by [`Half::seal_body`]).
    pub fn seal(&mut self, msg: &PeerMsg, payload_len: u64) -> Result<Vec<u8>, PeerError> {
        let f = encode_frame(msg, payload_len).map_err(|e| PeerError::Protocol(e.to_string()))?;
        Ok(self.seal_encoded(f))
    }

    /// Seals an encoded frame head (prefix + header bytes, whatever they hold) as the next
    /// frame. Only [`Half::seal`] and tests of a key holder sending garbage use it.
    pub fn seal_encoded(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        let (prefix, header) = f.split_at_mut(PREFIX_LEN);
        match &self.protect {
            Protect::Mac(k) => {
                let t = Self::mac(k, self.seq, prefix, header);
                f.extend_from_slice(t.as_bytes());
            }
            Protect::Aead(c) => {
                let t = c
                    .encrypt_in_place_detached(&nonce(0, self.seq), prefix, header)
                    .expect("a header is far below the AES-GCM message limit");
                f.extend_from_slice(&t);
            }
        }
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
            .map_err(|e| PeerError::Frame(e.into()))
            .and_then(|p| check_prefix(p).map_err(PeerError::Frame))?;
        let seq = self.seq;
        match &self.protect {
            Protect::Mac(k) => {
                let want = Self::mac(k, seq, prefix, header);
                let got: [u8; MAC_TAG_LEN] = tag.try_into().map_err(|_| integrity("short tag"))?;
                // blake3::Hash compares in constant time.
                if want != blake3::Hash::from(got) {
                    return Err(integrity(
                        "frame tag mismatch (altered, injected, dropped or reordered frame)",
                    ));
                }
            }
            Protect::Aead(c) => {
                let t = Tag::from_exact_iter(tag.iter().copied())
                    .ok_or_else(|| integrity("short tag"))?;
                c.decrypt_in_place_detached(&nonce(0, seq), prefix, header, &t)
                    .map_err(|_| {
                        integrity(
                            "frame failed to decrypt (altered, injected, dropped or reordered frame)",
                        )
                    })?;
            }
        }
        self.seq += 1;
        Ok((decode_peer(p, header).map_err(PeerError::Frame)?, seq))
    }

    /// Decrypts a `Block` body in place, received in the frame sealed under `seq`, against the
    /// tag from its header. Authentication-only halves leave `body` alone.
    pub fn open_body(&self, seq: u64, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        let Protect::Aead(c) = &self.protect else {
            return Ok(());
        };
        let t = Tag::from_exact_iter(seal.iter().copied())
            .ok_or_else(|| integrity("block without its encryption tag"))?;
        c.decrypt_in_place_detached(&nonce(1, seq), &[], body, &t)
            .map_err(|_| integrity("block body failed to decrypt (altered in transit)"))
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
}

impl Channel {
    /// The session keys from `secret` (cluster key and transcript, see `peer::auth`).
    pub fn new(secret: &[u8], encrypt: bool, side: Side) -> Self {
        let d2s = Half::new(secret, D2S_MAC, D2S_AEAD, encrypt);
        let s2d = Half::new(secret, S2D_MAC, S2D_AEAD, encrypt);
        let (send, recv) = match side {
            Side::Destination => (d2s, s2d),
            Side::Source => (s2d, d2s),
        };
        Self {
            send,
            recv,
            key_id: None,
        }
    }

    /// Records the session's key id.
    #[must_use]
    pub fn with_key(mut self, id: Option<u64>) -> Self {
        self.key_id = id;
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
                Err(PeerError::Integrity(_))
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
            if !encrypt {
                assert!(f0.windows(4).any(|w| w == b"Ping"), "plain header");
            }
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
}
