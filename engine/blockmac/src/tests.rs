//! The fast POLYVAL at every width this CPU has, checked against RFC 8452's vectors, a
//! bit-by-bit reference, and RustCrypto's `polyval`; and the tag's own properties (pieces
//! give the one-shot tag, any change changes it).

use polyval::Polyval;
use polyval::universal_hash::UniversalHash;
use proptest::prelude::*;

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

/// Bit-by-bit POLYVAL from state `s0` (a trailing partial block zero-padded).
fn polyval_slow_from(h: u128, s0: u128, data: &[u8]) -> u128 {
    let xi = x_inv_128();
    data.chunks(16).fold(s0, |s, c| {
        let mut b = [0u8; 16];
        b[..c.len()].copy_from_slice(c);
        mul(mul(s ^ u128::from_le_bytes(b), h), xi)
    })
}

fn polyval_slow(h: u128, data: &[u8]) -> u128 {
    polyval_slow_from(h, 0, data)
}

/// RustCrypto's POLYVAL of `data` (zero-padded) under `h`.
fn polyval_rustcrypto(h: u128, data: &[u8]) -> u128 {
    let mut p = Polyval::new(&h.to_le_bytes().into());
    p.update_padded(data);
    u128::from_le_bytes(p.finalize().into())
}

/// The tag as RustCrypto computes it: POLYVAL over the zero-padded bytes and the length
/// block (the format [`BlockMac::finish`] documents).
fn tag_rustcrypto(h: u128, data: &[u8]) -> [u8; TAG_LEN] {
    let mut p = Polyval::new(&h.to_le_bytes().into());
    p.update_padded(data);
    p.update_padded(&u128::from(data.len() as u64).to_le_bytes());
    p.finalize().into()
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex {s}");
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn hex_u128(s: &str) -> u128 {
    u128::from_le_bytes(hex(s).try_into().expect("16 bytes"))
}

/// The fast POLYVAL for `h` at every width this CPU runs. A CPU without PCLMULQDQ fails
/// the test, unless `KVNODE_TEST_ALLOW_SKIP` lists `clmul` (or `all`): such CPUs verify
/// blocks by BLAKE3, whose tests run everywhere, and this test then checks the references
/// only. Widths this CPU lacks are named on stderr as not exercised.
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

/// RFC 8452: Appendix A's POLYVAL example, then the POLYVAL input and result of AES-GCM-SIV
/// vectors of Appendix C.1 (record authentication key `d9b3…7377`).
const RFC_8452: &[(&str, &str, &str)] = &[
    (
        "25629347589242761d31f826ba4b757b",
        "4f4f95668c83dfb6401762bb2d01a262d1a24ddd2721d006bbe45f20d3c9f362",
        "f7a3b47b846119fae5b7866cf5e5b77e",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "00000000000000000000000000000000",
        "00000000000000000000000000000000",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "0100000000000000000000000000000000000000000000004000000000000000",
        "eb93b7740962c5e49d2a90a7dc5cec74",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "0100000000000000000000000000000000000000000000006000000000000000",
        "48eb6c6c5a2dbe4a1dde508fee06361b",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "0100000000000000000000000000000000000000000000008000000000000000",
        "20806c26e3c1de019e111255708031d6",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "01000000000000000000000000000000\
         02000000000000000000000000000000\
         00000000000000000001000000000000",
        "ce6edc9a50b36d9a98986bbf6a261c3b",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "01000000000000000000000000000000\
         02000000000000000000000000000000\
         03000000000000000000000000000000\
         00000000000000008001000000000000",
        "81388746bc22d26b2abc3dcb15754222",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "01000000000000000000000000000000\
         02000000000000000000000000000000\
         03000000000000000000000000000000\
         04000000000000000000000000000000\
         00000000000000000002000000000000",
        "1e39b6d3344d348f6044f89935d1cf78",
    ),
    (
        "d9b360279694941ac5dbc6987ada7377",
        "01000000000000000000000000000000\
         02000000000000000000000000000000\
         03000000000000000000000000000000\
         04000000000000000000000000000000\
         05000000000000000000000000000000\
         08000000000000000002000000000000",
        "ffcd05d5770f34ad9267f0a59994b15a",
    ),
];

#[test]
fn matches_rfc_8452_vectors_at_every_width_and_in_both_references() {
    for &(h, x, want) in RFC_8452 {
        let (h, x, want) = (hex_u128(h), hex(x), hex_u128(want));
        assert_eq!(polyval_slow(h, &x), want, "bitwise reference");
        assert_eq!(polyval_rustcrypto(h, &x), want, "RustCrypto polyval");
        for k in every_width(h) {
            assert_eq!(k.absorb(0, &x), want, "{:?}", k.width());
        }
    }
}

#[test]
fn matches_the_bitwise_reference_at_every_length_and_width() {
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
        // A state carried in from earlier pieces is folded in at the first block.
        let want_s0 = polyval_slow_from(h, s0, &data);
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

/// Random data of up to `max` bytes, with cut points that split it into pieces the way
/// [`BlockMac::update`] allows (every piece but the last a multiple of 16).
fn data_and_cuts(max: usize) -> impl Strategy<Value = (Vec<u8>, Vec<usize>)> {
    proptest::collection::vec(any::<u8>(), 0..max).prop_flat_map(|data| {
        let blocks = data.len() / 16;
        let cuts = proptest::collection::vec(0..=blocks, 0..4);
        (Just(data), cuts)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every width against RustCrypto's POLYVAL, over random keys and messages long enough
    /// to cross the 256-byte aggregated step several times.
    #[test]
    fn every_width_matches_rustcrypto_polyval(
        h in any::<u128>(),
        data in proptest::collection::vec(any::<u8>(), 0..2_000),
    ) {
        let want = polyval_rustcrypto(h, &data);
        for k in every_width(h) {
            prop_assert_eq!(k.absorb(0, &data), want, "{:?}", k.width());
        }
    }

    /// The tag of a message fed in pieces equals RustCrypto's POLYVAL over the message and
    /// its length block, at every width.
    #[test]
    fn the_tag_in_pieces_matches_rustcrypto_polyval_with_the_length_block(
        h in any::<u128>(),
        (data, mut cuts) in data_and_cuts(3_000),
    ) {
        let want = tag_rustcrypto(h, &data);
        cuts.sort_unstable();
        for k in every_width(h) {
            let width = k.width();
            let mac = BlockMac { id: 1, k };
            let mut st = MacState::default();
            let mut at = 0;
            for c in &cuts {
                mac.update(&mut st, &data[at..16 * c]);
                at = 16 * c;
            }
            mac.update(&mut st, &data[at..]);
            prop_assert_eq!(mac.finish(st), want, "{:?}", width);
            prop_assert_eq!(mac.tag(&data), want, "{:?}", width);
        }
    }
}

#[test]
fn the_key_is_blake3_derived_from_the_cluster_key() {
    let key = b"a cluster key of enough bytes";
    let Some(mac) = BlockMac::for_key(7, key) else {
        assert!(
            every_width(1).is_empty(),
            "the CPU check disagrees with itself"
        );
        return;
    };
    let d = blake3::derive_key(KDF_CONTEXT, key);
    let h = u128::from_le_bytes(d[..16].try_into().unwrap());
    let data = b"some block bytes, not a multiple of sixteen";
    assert_eq!(mac.tag(data), tag_rustcrypto(h, data));
    assert_eq!(mac.id(), 7);
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
