//! POLYVAL on x86-64 with carry-less multiplies, 16 blocks per step (aggregated: block `j`
//! of a step is multiplied by `H^(16-j)`, one reduction per step), at the widest register
//! the CPU has: AVX-512 VPCLMULQDQ (four blocks per multiply), AVX2 VPCLMULQDQ (two), or
//! PCLMULQDQ alone (one). All three compute the same function; the tests check each the CPU
//! has against a bitwise reference.

use std::arch::x86_64::{
    __m128i, __m256i, __m512i, _mm_clmulepi64_si128, _mm_loadu_si128, _mm_setr_epi32,
    _mm_setzero_si128, _mm_shuffle_epi32, _mm_slli_si128, _mm_srli_si128, _mm_xor_si128,
    _mm256_castsi256_si128, _mm256_clmulepi64_epi128, _mm256_extracti128_si256, _mm256_loadu_si256,
    _mm256_setzero_si256, _mm256_xor_si256, _mm256_zextsi128_si256, _mm512_clmulepi64_epi128,
    _mm512_extracti32x4_epi32, _mm512_loadu_si512, _mm512_setzero_si512, _mm512_xor_si512,
    _mm512_zextsi128_si512,
};

/// Blocks per step of the aggregated loop.
const WIDE: usize = 16;

/// Bytes per step.
const STEP: usize = 16 * WIDE;

/// Which registers the loop runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// AVX-512F + VPCLMULQDQ: 512-bit registers.
    Zmm,
    /// AVX2 + VPCLMULQDQ: 256-bit registers.
    Ymm,
    /// PCLMULQDQ: 128-bit registers.
    Xmm,
}

impl Width {
    /// Whether this CPU runs this width.
    pub fn available(self) -> bool {
        let clmul = is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse2");
        clmul
            && match self {
                Self::Zmm => {
                    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("vpclmulqdq")
                }
                Self::Ymm => {
                    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("vpclmulqdq")
                }
                Self::Xmm => true,
            }
    }

    /// The widest this CPU runs; `None` without PCLMULQDQ.
    pub fn best() -> Option<Self> {
        [Self::Zmm, Self::Ymm, Self::Xmm]
            .into_iter()
            .find(|w| w.available())
    }
}

/// `H^1..H^16` (POLYVAL's product, which includes the factor x^-128), and the width the
/// loop runs at. Exists only where that width's instructions are present.
pub struct Powers {
    pw: [u128; WIDE],
    width: Width,
}

fn m(x: u128) -> __m128i {
    // SAFETY: __m128i is 16 plain bytes.
    unsafe { std::mem::transmute::<[u8; 16], __m128i>(x.to_le_bytes()) }
}

fn u(x: __m128i) -> u128 {
    // SAFETY: as above.
    u128::from_le_bytes(unsafe { std::mem::transmute::<__m128i, [u8; 16]>(x) })
}

impl Powers {
    /// The powers of `h` at the widest width this CPU runs (`None` without PCLMULQDQ).
    pub fn new(h: u128) -> Option<Self> {
        Self::at(h, Width::best()?)
    }

    /// The powers of `h` at `width` (`None` where this CPU lacks its instructions).
    pub fn at(h: u128, width: Width) -> Option<Self> {
        if !width.available() {
            return None;
        }
        let mut pw = [h; WIDE];
        for k in 1..WIDE {
            // SAFETY: the CPU has PCLMULQDQ (every width needs it; checked above).
            pw[k] = u(unsafe { dot(m(pw[k - 1]), m(h)) });
        }
        Some(Self { pw, width })
    }

    /// The width the loop runs at.
    #[cfg(test)]
    pub fn width(&self) -> Width {
        self.width
    }

    /// POLYVAL state `s` after `data` (a trailing partial block zero-padded).
    pub fn absorb(&self, s: u128, data: &[u8]) -> u128 {
        let (steps, rest) = data.split_at(data.len() - data.len() % STEP);
        // SAFETY: a `Powers` exists only where `at` found the instructions of its width.
        let s = unsafe {
            match self.width {
                Width::Zmm => self.zmm(m(s), steps),
                Width::Ymm => self.ymm(m(s), steps),
                Width::Xmm => self.xmm(m(s), steps),
            }
        };
        // SAFETY: as above (every width has PCLMULQDQ).
        u(unsafe { self.tail(s, rest) })
    }

    /// `H^(16-j)` for block `j` of a step.
    fn power_of_block(&self, j: usize) -> u128 {
        self.pw[WIDE - 1 - j]
    }

    /// The powers of blocks `first..first + N` of a step, as one register's bytes.
    fn lane_bytes<const B: usize>(&self, first: usize) -> [u8; B] {
        let mut b = [0u8; B];
        for (i, c) in b.chunks_exact_mut(16).enumerate() {
            c.copy_from_slice(&self.power_of_block(first + i).to_le_bytes());
        }
        b
    }

    /// Whole steps (`data.len()` a multiple of [`STEP`]), four blocks per register.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq")]
    fn zmm(&self, mut s: __m128i, data: &[u8]) -> __m128i {
        let hp: [__m512i; 4] = std::array::from_fn(|r| {
            let b = self.lane_bytes::<64>(4 * r);
            // SAFETY: 64 bytes.
            unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
        });
        for c in data.chunks_exact(STEP) {
            let p = c.as_ptr();
            // SAFETY: `c` holds STEP bytes; unaligned loads.
            let mut xs: [__m512i; 4] =
                std::array::from_fn(|r| unsafe { _mm512_loadu_si512(p.add(64 * r).cast()) });
            xs[0] = _mm512_xor_si512(xs[0], _mm512_zextsi128_si512(s));
            let (mut lo, mut hi, mut mid) = (
                _mm512_setzero_si512(),
                _mm512_setzero_si512(),
                _mm512_setzero_si512(),
            );
            for (x, h) in xs.into_iter().zip(hp) {
                lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(x, h, 0x00));
                hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(x, h, 0x11));
                mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(x, h, 0x10));
                mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(x, h, 0x01));
            }
            s = combine(fold512(lo), fold512(hi), fold512(mid));
        }
        s
    }

    /// Whole steps, two blocks per register.
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq")]
    fn ymm(&self, mut s: __m128i, data: &[u8]) -> __m128i {
        let hp: [__m256i; 8] = std::array::from_fn(|r| {
            let b = self.lane_bytes::<32>(2 * r);
            // SAFETY: 32 bytes.
            unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
        });
        for c in data.chunks_exact(STEP) {
            let p = c.as_ptr();
            // SAFETY: `c` holds STEP bytes; unaligned loads.
            let mut xs: [__m256i; 8] =
                std::array::from_fn(|r| unsafe { _mm256_loadu_si256(p.add(32 * r).cast()) });
            xs[0] = _mm256_xor_si256(xs[0], _mm256_zextsi128_si256(s));
            let (mut lo, mut hi, mut mid) = (
                _mm256_setzero_si256(),
                _mm256_setzero_si256(),
                _mm256_setzero_si256(),
            );
            for (x, h) in xs.into_iter().zip(hp) {
                lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(x, h, 0x00));
                hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(x, h, 0x11));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(x, h, 0x10));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(x, h, 0x01));
            }
            s = combine(fold256(lo), fold256(hi), fold256(mid));
        }
        s
    }

    /// Whole steps, one block per register.
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn xmm(&self, mut s: __m128i, data: &[u8]) -> __m128i {
        let hp: [__m128i; WIDE] = std::array::from_fn(|j| m(self.power_of_block(j)));
        for c in data.chunks_exact(STEP) {
            let p = c.as_ptr();
            let (mut lo, mut hi, mut mid) = (
                _mm_setzero_si128(),
                _mm_setzero_si128(),
                _mm_setzero_si128(),
            );
            for (j, h) in hp.into_iter().enumerate() {
                // SAFETY: `c` holds STEP bytes; unaligned load of block `j`.
                let mut x = unsafe { _mm_loadu_si128(p.add(16 * j).cast()) };
                if j == 0 {
                    x = _mm_xor_si128(x, s);
                }
                lo = _mm_xor_si128(lo, _mm_clmulepi64_si128::<0x00>(x, h));
                hi = _mm_xor_si128(hi, _mm_clmulepi64_si128::<0x11>(x, h));
                mid = _mm_xor_si128(mid, _mm_clmulepi64_si128::<0x10>(x, h));
                mid = _mm_xor_si128(mid, _mm_clmulepi64_si128::<0x01>(x, h));
            }
            s = combine(lo, hi, mid);
        }
        s
    }

    /// Fewer than [`WIDE`] blocks, one at a time, the last zero-padded.
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn tail(&self, mut s: __m128i, rest: &[u8]) -> __m128i {
        let h1 = m(self.pw[0]);
        let mut blocks = rest.chunks_exact(16);
        for b in &mut blocks {
            // SAFETY: `b` holds 16 bytes.
            let x = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
            s = dot(_mm_xor_si128(s, x), h1);
        }
        let tail = blocks.remainder();
        if !tail.is_empty() {
            let mut pad = [0u8; 16];
            pad[..tail.len()].copy_from_slice(tail);
            s = dot(_mm_xor_si128(s, m(u128::from_le_bytes(pad))), h1);
        }
        s
    }
}

/// XOR of a register's four 128-bit lanes.
#[target_feature(enable = "avx512f")]
fn fold512(v: __m512i) -> __m128i {
    let a = _mm512_extracti32x4_epi32::<0>(v);
    let b = _mm512_extracti32x4_epi32::<1>(v);
    let c = _mm512_extracti32x4_epi32::<2>(v);
    let d = _mm512_extracti32x4_epi32::<3>(v);
    _mm_xor_si128(_mm_xor_si128(a, b), _mm_xor_si128(c, d))
}

/// XOR of a register's two 128-bit lanes.
#[target_feature(enable = "avx2")]
fn fold256(v: __m256i) -> __m128i {
    _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
}

/// The reduced sum of a step's products, from their low, high and middle halves.
#[target_feature(enable = "pclmulqdq,sse2")]
fn combine(lo: __m128i, hi: __m128i, mid: __m128i) -> __m128i {
    let lo = _mm_xor_si128(lo, _mm_slli_si128::<8>(mid));
    let hi = _mm_xor_si128(hi, _mm_srli_si128::<8>(mid));
    reduce(lo, hi)
}

/// POLYVAL's product `a * b * x^-128` (Gueron's carry-less multiply and Montgomery
/// reduction, as in the AES-GCM-SIV reference code).
#[target_feature(enable = "pclmulqdq,sse2")]
fn dot(a: __m128i, b: __m128i) -> __m128i {
    let lo = _mm_clmulepi64_si128::<0x00>(a, b);
    let hi = _mm_clmulepi64_si128::<0x11>(a, b);
    let mid = _mm_xor_si128(
        _mm_clmulepi64_si128::<0x10>(a, b),
        _mm_clmulepi64_si128::<0x01>(a, b),
    );
    combine(lo, hi, mid)
}

/// Reduces the 256-bit product `hi:lo` (two folds by x^-64 each).
#[target_feature(enable = "pclmulqdq,sse2")]
fn reduce(lo: __m128i, hi: __m128i) -> __m128i {
    let poly = _mm_setr_epi32(1, 0, 0, 0xc200_0000_u32.cast_signed());
    let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
    let lo = _mm_xor_si128(_mm_shuffle_epi32::<78>(lo), t);
    let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
    let lo = _mm_xor_si128(_mm_shuffle_epi32::<78>(lo), t);
    _mm_xor_si128(hi, lo)
}
