//! kvnode's peer block MAC: POLYVAL (RFC 8452, the universal hash of AES-GCM-SIV) of a
//! block's bytes and length, under a key derived from the cluster key.
//!
//! ```text
//!  cluster key --BLAKE3 derive_key--> H (16 bytes)  -->  BlockMac { H^1..H^16, width }
//!                                                          |
//!  block bytes, in pieces (16-byte multiples, the last any) | update(&mut MacState, piece)
//!                                                          v
//!  tag = POLYVAL_H(bytes || zero pad || le64(len) || 0^8)    finish(MacState) -> [u8; 16]
//! ```
//!
//! Why: verifying a pulled block by its BLAKE3 hash costs one BLAKE3 pass per byte at the
//! destination (~4–7 GB/s per core, 40 % of the destination's CPU per pulled GB); POLYVAL
//! with carry-less multiplies runs at ~24 GB/s on AVX-512 VPCLMULQDQ and several times
//! BLAKE3's rate on AVX2 VPCLMULQDQ or plain PCLMULQDQ ([`x86`] picks the widest). The
//! source computes the tag once per block and key (with the block's hash, from the same
//! bytes) and caches it; it travels in the `Block` header's `seal`, which is AES-256-GCM
//! ciphertext in every session, so the tag is never visible on the wire. The destination
//! checks it as the bytes land instead of hashing them. The security argument is in
//! docs/peer-protocol.md ("Block MAC").
//!
//! Either side without PCLMULQDQ (every x86-64 CPU since 2010 has it; other architectures
//! have no implementation yet), a keyless session, or an encrypted one (the AEAD tag then
//! fills `seal`) uses BLAKE3 as before: a source leaves `seal` empty, a destination ignores
//! a tag it cannot check and hashes. Old and new daemons interoperate.
//!
//! The crate knows nothing of peers or sessions. Its tests check the fast code at every
//! width the CPU has against RFC 8452's vectors, a bit-by-bit reference and RustCrypto's
//! `polyval` (a dev-dependency), the last over random keys, messages and piece splits.

/// BLAKE3 key-derivation context of the POLYVAL key.
const KDF_CONTEXT: &str = "kvnode 2026-12 peer block mac polyval";

/// Bytes of a tag.
pub const TAG_LEN: usize = 16;

/// POLYVAL under one cluster key, with the powers of its hash key precomputed. Exists only
/// on a CPU with the instructions [`imp`] needs.
pub struct BlockMac {
    /// Id of the cluster key it was derived from (the tag cache's key).
    id: u64,
    k: imp::Powers,
}

impl std::fmt::Debug for BlockMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMac")
            .field("key_id", &self.id)
            .finish_non_exhaustive()
    }
}

/// A tag being computed over bytes that arrive in pieces.
#[derive(Clone, Copy, Debug, Default)]
pub struct MacState {
    s: u128,
    len: u64,
    /// Whether a piece ended off a 16-byte boundary (it was zero-padded: the last piece).
    padded: bool,
}

impl BlockMac {
    /// The MAC for cluster key `key` (id `id`); `None` on a CPU without carry-less
    /// multiplies (then blocks are verified by BLAKE3).
    pub fn for_key(id: u64, key: &[u8]) -> Option<Self> {
        let d = blake3::derive_key(KDF_CONTEXT, key);
        let h = u128::from_le_bytes(d[..16].try_into().expect("16 bytes"));
        if h == 0 {
            return None;
        }
        imp::Powers::new(h).map(|k| Self { id, k })
    }

    /// Id of the cluster key.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Absorbs `piece`. Every piece but the last must be a multiple of 16 bytes long.
    pub fn update(&self, st: &mut MacState, piece: &[u8]) {
        debug_assert!(!st.padded, "a piece after a padded one");
        st.padded = !piece.len().is_multiple_of(16);
        st.s = self.k.absorb(st.s, piece);
        st.len += piece.len() as u64;
    }

    /// The tag: POLYVAL over the bytes (zero-padded to 16) and a final block holding their
    /// length in bytes (little-endian u64, then 8 zero bytes).
    pub fn finish(&self, st: MacState) -> [u8; TAG_LEN] {
        let len = u128::from(st.len).to_le_bytes();
        self.k.absorb(st.s, &len).to_le_bytes()
    }

    /// The tag of `bytes`.
    pub fn tag(&self, bytes: &[u8]) -> [u8; TAG_LEN] {
        let mut st = MacState::default();
        self.update(&mut st, bytes);
        self.finish(st)
    }
}

/// Whether this CPU computes the block MAC (else keyed sessions verify blocks by BLAKE3).
pub fn available() -> bool {
    imp::Powers::new(1).is_some()
}

/// Whether two tags are equal, in time independent of where they differ.
pub fn tags_equal(a: &[u8; TAG_LEN], b: &[u8]) -> bool {
    b.len() == TAG_LEN && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86 as imp;

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    /// No wide carry-less multiply on this architecture: blocks are verified by BLAKE3.
    pub struct Powers;

    impl Powers {
        pub fn new(_h: u128) -> Option<Self> {
            None
        }

        pub fn absorb(&self, _s: u128, _data: &[u8]) -> u128 {
            unreachable!("no Powers exist on this architecture")
        }

        #[cfg(test)]
        pub fn width(&self) -> &'static str {
            unreachable!("no Powers exist on this architecture")
        }
    }
}

#[cfg(test)]
mod tests;
