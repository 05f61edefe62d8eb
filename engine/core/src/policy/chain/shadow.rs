//! Sampled shadows that pick `chain`'s weight of reuse against recency (miniature simulation,
//! Waldspurger et al., ATC '17): one key in 32 is also referenced in a few small copies of the
//! policy, each 1/32 of the tier's size with its own weight; the policy uses the weight of the
//! copy with the most hits lately. Where reuse comes back sooner than the cache turns over, the
//! recency-only copy (weight 0: LRU with chains cut from the tail) wins and the policy follows
//! it; where reuse comes back later, a heavier weight keeps the reused blocks.
//!
//! Cost: a sampled reference does `O(log n)` work in each of the [`WEIGHTS`] copies; the
//! copies hold `len(WEIGHTS) / 32` of the tier's entries, and ghosts alike.

use super::core::{Core, Placement};

/// Keys sampled: those whose mixed hash has this many leading zero bits (1 in 32).
const SAMPLE_SHIFT: u32 = 5;
/// Weights tried, per mille of the tier's blocks per use.
pub(super) const WEIGHTS: [u64; 4] = [0, 500, 2000, 8000];
/// The weight used before the shadows have an opinion (an index into [`WEIGHTS`]).
const START: usize = 1;
/// Hit counts halve every this many sampled references, at least.
const WINDOW_MIN: u64 = 256;
/// ... or every this many times the shadows' size, if more.
const WINDOW_PER_SLOT: u64 = 16;
/// Ghost keys per shadow entry (as the policy keeps).
const GHOST_FACTOR: usize = 16;

#[derive(Debug)]
struct Shadow {
    core: Core,
    weight_milli: u64,
    hits: u64,
}

/// The shadows and the weight they elect.
#[derive(Debug)]
pub(super) struct Selector {
    shadows: Vec<Shadow>,
    refs: u64,
    best: usize,
    high_water: usize,
}

impl Default for Selector {
    fn default() -> Self {
        Self {
            shadows: WEIGHTS
                .iter()
                .map(|&w| Shadow {
                    core: Core::new(GHOST_FACTOR, 16),
                    weight_milli: w,
                    hits: 0,
                })
                .collect(),
            refs: 0,
            best: START,
            high_water: 0,
        }
    }
}

impl Selector {
    /// Whether `key_hash` is in the sample.
    pub fn sampled(key_hash: u64) -> bool {
        key_hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SAMPLE_SHIFT) == 0
    }

    /// The weight in force.
    pub fn weight_milli(&self) -> u64 {
        self.shadows[self.best].weight_milli
    }

    /// A reference to sampled `key_hash` at `batch_clock` and `depth`, while the policy tracks
    /// `tracked` blocks.
    pub fn reference(&mut self, key_hash: u64, batch_clock: u64, depth: u32, tracked: usize) {
        self.high_water = self.high_water.max(tracked);
        let cap = (self.high_water >> SAMPLE_SHIFT).max(1);
        for sh in &mut self.shadows {
            let uses = match sh.core.get(key_hash) {
                Some(e) => {
                    sh.hits += 1;
                    e.uses.saturating_add(1)
                }
                None => sh.core.take_ghost(key_hash).saturating_add(1),
            };
            let at = Placement {
                batch_clock,
                depth,
                weight_milli: sh.weight_milli,
                tracked: self.high_water,
            };
            sh.core.place(key_hash, key_hash, uses, at);
            while sh.core.len() > cap && sh.core.evict(&mut |_| true).is_some() {}
        }
        self.refs += 1;
        if self.refs >= WINDOW_MIN.max(WINDOW_PER_SLOT * cap as u64) {
            self.refs = 0;
            self.shadows.iter_mut().for_each(|s| s.hits /= 2);
        }
        let top = self.shadows[self.best].hits;
        if let Some((i, _)) = self
            .shadows
            .iter()
            .enumerate()
            .filter(|(_, s)| s.hits > top)
            .max_by_key(|(_, s)| s.hits)
        {
            self.best = i;
        }
    }
}
