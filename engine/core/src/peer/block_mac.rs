//! The block MAC of keyed plaintext sessions: POLYVAL (RFC 8452, the universal hash of
//! AES-GCM-SIV) of a block's bytes and length, under a key derived from the cluster key.
//!
//! Why: verifying a pulled block by its BLAKE3 hash costs one BLAKE3 pass per byte at the
//! destination (~4–7 GB/s per core, 40 % of the destination's CPU per pulled GB); POLYVAL
//! with carry-less multiplies runs at ~24 GB/s on AVX-512 VPCLMULQDQ and several times
//! BLAKE3's rate on AVX2 VPCLMULQDQ or plain PCLMULQDQ ([`x86`] picks the widest). The source computes the tag
//! once per block and key (with the block's hash, from the same bytes) and caches it
//! ([`super::hashes`]); it travels in the `Block` header's `seal`, which is AES-256-GCM
//! ciphertext in every session, so the tag is never visible on the wire. The destination
//! checks it as the bytes land instead of hashing them. The security argument is in
//! docs/peer-protocol.md ("Block MAC").
//!
//! Either side without PCLMULQDQ (every x86-64 CPU since 2010 has it; other architectures
//! have no implementation yet), a keyless session, or an encrypted one (the AEAD tag then
//! fills `seal`) uses BLAKE3 as before: a source leaves `seal` empty, a
//! destination ignores a tag it cannot check and hashes. Old and new daemons interoperate.

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
mod tests {
    use super::*;

    /// POLYVAL's field, bit by bit: x^128 = x^127 + x^126 + x^121 + 1, bit i = x^i.
    const R: u128 = 0xC200_0000_0000_0000_0000_0000_0000_0001;

    fn mul(mut a: u128, b: u128) -> u128 {
        let mut r = 0;
        for i in 0..128 {
            if (b >> i) & 1 == 1 {
                r ^= a;
            }
            let c = a >> 127;
            a = (a << 1) ^ if c == 1 { R } else { 0 };
        }
        r
    }

    /// x^-128 (x^-1 = x^127 + x^126 + x^125 + x^120).
    fn x_inv_128() -> u128 {
        (0..128).fold(1, |r, _| mul(r, 0xE100_0000_0000_0000_0000_0000_0000_0000))
    }

    fn polyval_slow(h: u128, data: &[u8]) -> u128 {
        let xi = x_inv_128();
        data.chunks(16).fold(0, |s, c| {
            let mut b = [0u8; 16];
            b[..c.len()].copy_from_slice(c);
            mul(mul(s ^ u128::from_le_bytes(b), h), xi)
        })
    }

    fn hex(s: &str) -> [u8; 16] {
        let v: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        v.try_into().unwrap()
    }

    /// The fast POLYVAL for `h` at every width this CPU runs. A CPU without PCLMULQDQ fails
    /// the test, unless `KVNODE_TEST_ALLOW_SKIP` lists `clmul` (or `all`): such CPUs verify
    /// blocks by BLAKE3, whose tests run everywhere, and this test then checks the bitwise
    /// reference only. Widths this CPU lacks are named on stderr as not exercised.
    #[cfg(target_arch = "x86_64")]
    fn every_width(h: u128) -> Vec<imp::Powers> {
        use x86::Width;
        let all = [Width::Zmm, Width::Ymm, Width::Xmm];
        let have: Vec<imp::Powers> = all.iter().filter_map(|&w| imp::Powers::at(h, w)).collect();
        for w in all
            .iter()
            .filter(|w| !have.iter().any(|p| p.width() == **w))
        {
            eprintln!("block MAC width {w:?}: not on this CPU, not exercised");
        }
        if have.is_empty() {
            allowed_without_clmul();
        }
        have
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn every_width(_h: u128) -> Vec<imp::Powers> {
        allowed_without_clmul();
        Vec::new()
    }

    fn allowed_without_clmul() {
        let allowed = std::env::var("KVNODE_TEST_ALLOW_SKIP").unwrap_or_default();
        assert!(
            allowed
                .split(',')
                .any(|w| w.trim() == "clmul" || w.trim() == "all"),
            "this CPU has no carry-less multiply, so the block MAC is not exercised; set KVNODE_TEST_ALLOW_SKIP=clmul to skip on purpose"
        );
        eprintln!("\n!!!!! SKIPPING (KVNODE_TEST_ALLOW_SKIP={allowed}): no PCLMULQDQ !!!!!\n");
    }

    #[test]
    fn matches_rfc_8452_and_a_bitwise_reference_at_every_length_and_width() {
        // RFC 8452, Appendix A: POLYVAL(H, X_1, X_2).
        let h = u128::from_le_bytes(hex("25629347589242761d31f826ba4b757b"));
        let mut x = hex("4f4f95668c83dfb6401762bb2d01a262").to_vec();
        x.extend(hex("d1a24ddd2721d006bbe45f20d3c9f362"));
        let want = u128::from_le_bytes(hex("f7a3b47b846119fae5b7866cf5e5b77e"));
        assert_eq!(polyval_slow(h, &x), want);
        for k in every_width(h) {
            assert_eq!(k.absorb(0, &x), want);
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in (0..600).chain([4095, 4096, 4097, 65_536 + 48]) {
            let h = (u128::from(rnd()) << 64) | u128::from(rnd());
            let data: Vec<u8> = (0..len).map(|_| rnd() as u8).collect();
            let s0 = (u128::from(rnd()) << 64) | u128::from(rnd());
            let want = polyval_slow(h, &data);
            let xi = x_inv_128();
            // A state carried in from earlier pieces is folded in at the first block.
            let want_s0 = data.chunks(16).fold(s0, |s, c| {
                let mut b = [0u8; 16];
                b[..c.len()].copy_from_slice(c);
                mul(mul(s ^ u128::from_le_bytes(b), h), xi)
            });
            for k in every_width(h) {
                assert_eq!(k.absorb(0, &data), want, "len {len}, {:?}", k.width());
                assert_eq!(
                    k.absorb(s0, &data),
                    want_s0,
                    "len {len} from a state, {:?}",
                    k.width()
                );
            }
        }
    }

    #[test]
    fn pieces_give_the_one_shot_tag_and_any_change_changes_it() {
        let Some(mac) = BlockMac::for_key(7, b"a cluster key of enough bytes") else {
            assert!(
                every_width(1).is_empty(),
                "the CPU check disagrees with itself"
            );
            return;
        };
        let data: Vec<u8> = (0..(1usize << 20) + 100)
            .map(|i| (i * 31 + 7) as u8)
            .collect();
        let one = mac.tag(&data);
        let mut st = MacState::default();
        for p in data.chunks(128 << 10) {
            mac.update(&mut st, p);
        }
        assert!(tags_equal(&one, &mac.finish(st)));
        // A flipped bit anywhere, a dropped byte, an appended zero: another tag.
        for at in [0, 15, 16, 4097, data.len() - 1] {
            let mut bad = data.clone();
            bad[at] ^= 0x20;
            assert!(!tags_equal(&one, &mac.tag(&bad)), "flip at {at}");
        }
        assert!(!tags_equal(&one, &mac.tag(&data[..data.len() - 1])));
        let mut longer = data.clone();
        longer.push(0);
        assert!(!tags_equal(&one, &mac.tag(&longer)));
        // Another key, another tag; a short or long tag never equals.
        let other = BlockMac::for_key(8, b"another cluster key, same length").unwrap();
        assert!(!tags_equal(&one, &other.tag(&data)));
        assert!(!tags_equal(&one, &one[..15]));
    }
}
