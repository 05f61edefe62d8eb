//! Offline hit rates of one cache over a trace: the infinite-cache ceiling, Belady's MIN and
//! the daemon's own eviction policies (the same code the DRAM tier runs), computed from the
//! trace alone. A request hits its leading run of cached blocks; every block of the request is
//! then referenced (the hits read, the rest computed and offloaded), as an engine does.
//!
//! [`simulate`] calls the policy exactly as the DRAM tier does for an engine that gets a
//! request's pages in one call (every resident page is leased and touched, as one batch of the
//! resident pages: [`Tier::lease`]) and then puts the pages after its leading hit run as the replay's engines do
//! ([`Tier::put`]: ops of [`super::tier::PUT_KEYS`] keys, each reserving its slots, victims
//! included, before committing them; a resident page is refused as `Exists` and not touched
//! again).

use std::collections::{BTreeSet, HashMap, HashSet};

use kvnode_engine::policy::PolicyKind;

use super::tier::Tier;
use super::trace::Request;

/// Block references and hits of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Blocks the requests asked for.
    pub refs: u64,
    /// Of those, blocks in the leading cached run of their request.
    pub hits: u64,
}

impl Outcome {
    /// Hits over references (0 for an empty run).
    pub fn hit_rate(&self) -> f64 {
        if self.refs == 0 {
            0.0
        } else {
            self.hits as f64 / self.refs as f64
        }
    }
}

/// Leading blocks of `blocks` for which `cached` holds.
fn leading_run(blocks: &[u64], cached: impl Fn(u64) -> bool) -> usize {
    blocks.iter().take_while(|b| cached(**b)).count()
}

/// The hit rate with an infinite cache: every block seen before is still there.
pub fn ceiling(trace: &[Request]) -> Outcome {
    let mut seen = HashSet::new();
    let mut out = Outcome::default();
    for r in trace {
        out.refs += r.blocks.len() as u64;
        out.hits += leading_run(&r.blocks, |b| seen.contains(&b)) as u64;
        seen.extend(r.blocks.iter().copied());
    }
    out
}

/// Position of each reference's next use (`u64::MAX` when never used again), in trace order.
fn next_uses(trace: &[Request]) -> Vec<u64> {
    let total: usize = trace.iter().map(|r| r.blocks.len()).sum();
    let mut next = vec![u64::MAX; total];
    let mut later: HashMap<u64, u64> = HashMap::new();
    let flat: Vec<u64> = trace
        .iter()
        .flat_map(|r| r.blocks.iter().copied())
        .collect();
    for (pos, b) in flat.iter().enumerate().rev() {
        if let Some(n) = later.insert(*b, pos as u64) {
            next[pos] = n;
        }
    }
    next
}

/// Belady's MIN with `capacity` blocks: on overflow, the block used farthest in the future
/// leaves (possibly the one just referenced: MIN may bypass).
pub fn belady(trace: &[Request], capacity: usize) -> Outcome {
    let next = next_uses(trace);
    // The farthest next use is the lowest key.
    keyed_oracle(trace, capacity, |_, _, pos| {
        Some(std::cmp::Reverse(next[pos]))
    })
}

/// References of each reference's block after it (0: never used again), in trace order.
fn uses_left(trace: &[Request]) -> Vec<u32> {
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut left: Vec<u32> = trace
        .iter()
        .flat_map(|r| r.blocks.iter().copied())
        .collect::<Vec<u64>>()
        .into_iter()
        .rev()
        .map(|b| {
            let n = seen.entry(b).or_insert(0);
            let later = *n;
            *n += 1;
            later
        })
        .collect();
    left.reverse();
    left
}

/// A cache of `capacity` blocks kept by an order over keys that an oracle (MIN, or one of the
/// oracles below that know less) computes for each reference from its request's index, its
/// depth and its position in the trace; `None` drops the block (it is never used again). On
/// overflow the lowest key leaves, possibly the block just referenced.
fn keyed_oracle<K: Ord + Copy>(
    trace: &[Request],
    capacity: usize,
    mut key: impl FnMut(usize, usize, usize) -> Option<K>,
) -> Outcome {
    let mut held: HashMap<u64, K> = HashMap::new();
    let mut order: BTreeSet<(K, u64)> = BTreeSet::new();
    let mut out = Outcome::default();
    let mut pos = 0usize;
    for (ri, r) in trace.iter().enumerate() {
        out.refs += r.blocks.len() as u64;
        out.hits += leading_run(&r.blocks, |b| held.contains_key(&b)) as u64;
        for (depth, &b) in r.blocks.iter().enumerate() {
            if let Some(old) = held.remove(&b) {
                order.remove(&(old, b));
            }
            if let Some(k) = key(ri, depth, pos) {
                held.insert(b, k);
                order.insert((k, b));
            }
            pos += 1;
            if held.len() > capacity
                && let Some((_, victim)) = order.pop_first()
            {
                held.remove(&victim);
            }
        }
    }
    out
}

/// An oracle that knows **which** blocks will be used again, but not when or how often: a
/// block never used again is not kept, and the rest are kept in LRU order. What a perfect
/// admission filter in front of LRU would reach (docs/eviction.md, "Where it falls short").
pub fn reuse_oracle(trace: &[Request], capacity: usize) -> Outcome {
    let next = next_uses(trace);
    keyed_oracle(trace, capacity, |_, _, pos| {
        (next[pos] != u64::MAX).then_some(pos)
    })
}

/// An oracle that knows **how many more times** every block will be used, but not when: a
/// block never used again is not kept; on overflow the block with the fewest uses left
/// leaves (ties: the oldest request, then a request's tail before its head). Every policy
/// that ranks blocks by recency and counted reuse estimates what this oracle knows.
pub fn count_oracle(trace: &[Request], capacity: usize) -> Outcome {
    let left = uses_left(trace);
    keyed_oracle(trace, capacity, |ri, depth, pos| {
        (left[pos] > 0).then_some((left[pos], ri, usize::MAX - depth))
    })
}

/// The daemon's policy `kind` with `capacity` blocks, fed what the DRAM tier feeds it (see the
/// module's doc and [`Tier`]).
pub fn simulate(trace: &[Request], capacity: usize, kind: PolicyKind) -> Outcome {
    let mut tier = Tier::new(kind, capacity);
    let mut out = Outcome::default();
    for r in trace {
        let hit = leading_run(&r.blocks, |b| tier.holds(b));
        out.refs += r.blocks.len() as u64;
        out.hits += hit as u64;
        tier.lease(&r.blocks);
        tier.put(&r.blocks[hit..], |_| {});
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(blocks: &[u64]) -> Request {
        Request {
            at_ms: 0,
            input_tokens: blocks.len() as u32 * 512,
            output_tokens: 1,
            blocks: blocks.to_vec(),
        }
    }

    #[test]
    fn only_the_leading_run_hits() {
        // 1 2 3, then 1 9 3: block 3 is cached but behind a miss, so one hit.
        let t = [req(&[1, 2, 3]), req(&[1, 9, 3])];
        assert_eq!(ceiling(&t), Outcome { refs: 6, hits: 1 });
    }

    #[test]
    fn belady_keeps_the_block_used_soonest() {
        // Capacity 1: after [1] [2], MIN keeps 1 (used next) and bypasses 2.
        let t = [req(&[1]), req(&[2]), req(&[1]), req(&[2])];
        let min = belady(&t, 1);
        assert_eq!(min.hits, 1);
        // LRU keeps the newest and hits nothing.
        assert_eq!(simulate(&t, 1, PolicyKind::Lru).hits, 0);
    }

    #[test]
    fn the_reuse_oracle_keeps_no_block_that_never_comes_back() {
        // Capacity 1: [1] [2] [1]. LRU keeps 2 and misses 1; the oracle knows 2 never comes
        // back, keeps 1 and hits it.
        let t = [req(&[1]), req(&[2]), req(&[1])];
        assert_eq!(reuse_oracle(&t, 1).hits, 1);
        assert_eq!(simulate(&t, 1, PolicyKind::Lru).hits, 0);
    }

    #[test]
    fn the_count_oracle_keeps_the_block_with_more_uses_left() {
        // Capacity 1: [1] [2] [2] [1] [1]. Block 2 is used next, but block 1 has more uses
        // left (2 against 1): the count oracle keeps 1 and bypasses 2 (2 hits, requests 4
        // and 5); knowing the order of uses (MIN) gives 2 as well, by another path.
        let t = [req(&[1]), req(&[2]), req(&[2]), req(&[1]), req(&[1])];
        assert_eq!(uses_left(&t), vec![2, 1, 0, 1, 0]);
        assert_eq!(count_oracle(&t, 1).hits, 2);
        assert_eq!(
            reuse_oracle(&t, 1).hits,
            2,
            "the reuse oracle keeps the newest: 2, then 1"
        );
        // Capacity 1: [1] [2] [1] [3] [1]: block 1 has the uses; the count oracle never lets
        // it go, a tail-first tie break keeps a request's head.
        let t = [req(&[1]), req(&[2]), req(&[1]), req(&[3]), req(&[1])];
        assert_eq!(count_oracle(&t, 1).hits, 2);
        let t = [req(&[1, 2]), req(&[1, 2]), req(&[1, 9])];
        assert_eq!(count_oracle(&t, 1).hits, 2, "the head outranks its tail");
    }

    #[test]
    fn nothing_beats_min_or_the_ceiling() {
        // A small deterministic mix of shared prefixes and one-off tails.
        let mut t = Vec::new();
        let mut x = 7u64;
        for i in 0..400u64 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let stem = (x >> 60) % 5;
            t.push(req(&[
                1000 + stem,
                2000 + stem * 10 + (x >> 40) % 3,
                10_000 + i,
            ]));
        }
        for cap in [2, 4, 8, 32] {
            let min = belady(&t, cap).hits;
            let top = ceiling(&t).hits;
            for kind in [PolicyKind::Lru, PolicyKind::S3fifo, PolicyKind::Chain] {
                let h = simulate(&t, cap, kind).hits;
                assert!(
                    h <= min && min <= top,
                    "cap {cap} {kind:?}: {h} {min} {top}"
                );
            }
        }
    }
}
