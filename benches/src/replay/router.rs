//! The router: placement (round-robin, least-loaded, prefix affinity with a load bound) over
//! an index of which cache holds which block, and the `kv.fetch` hint a request carries to
//! the cache holding a longer prefix than its own. The live replay feeds the index from the
//! daemons' KV events (events.rs); the model feeds it from its own residency.

use std::collections::HashMap;

use super::config::{Placement, Setup};

/// Which caches hold each block, as the router last heard (bit `c` = cache `c`).
#[derive(Debug, Default)]
pub struct Index {
    held: HashMap<u64, u64>,
}

impl Index {
    /// Cache `c` stored `block`.
    pub fn stored(&mut self, c: usize, block: u64) {
        *self.held.entry(block).or_default() |= 1 << c;
    }

    /// Cache `c` dropped `block`.
    pub fn removed(&mut self, c: usize, block: u64) {
        if let Some(m) = self.held.get_mut(&block) {
            *m &= !(1 << c);
            if *m == 0 {
                self.held.remove(&block);
            }
        }
    }

    /// Cache `c` dropped everything.
    pub fn cleared(&mut self, c: usize) {
        self.held.retain(|_, m| {
            *m &= !(1 << c);
            *m != 0
        });
    }

    /// Leading blocks of `blocks` that cache `c` holds.
    pub fn run(&self, c: usize, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.held.get(b).is_some_and(|m| m & (1 << c) != 0))
            .count()
    }
}

/// Where a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Engine rank.
    pub engine: usize,
    /// With pulls: the cache to pull from and the leading blocks it holds (hint coverage).
    pub source: Option<(usize, usize)>,
}

/// Placement state.
#[derive(Debug)]
pub struct Router {
    placement: Placement,
    load_bound: usize,
    /// Cache of each engine (`None`: GPU only).
    cache_of: Vec<Option<usize>>,
    caches: usize,
    pulls: bool,
    next: usize,
}

impl Router {
    /// A router over `setup`'s engines; `cache_of[e]` is engine e's cache.
    pub fn new(setup: &Setup, cache_of: Vec<Option<usize>>, pulls: bool) -> Self {
        let caches = cache_of.iter().flatten().max().map_or(0, |m| m + 1);
        Self {
            placement: setup.placement,
            load_bound: setup.load_bound,
            cache_of,
            caches,
            pulls,
            next: 0,
        }
    }

    /// Places a request for `blocks`, given each engine's requests in flight.
    pub fn place(&mut self, blocks: &[u64], index: &Index, load: &[usize]) -> Decision {
        let n = self.cache_of.len();
        let runs: Vec<usize> = (0..self.caches).map(|c| index.run(c, blocks)).collect();
        let run_of = |e: usize| self.cache_of[e].map_or(0, |c| runs[c]);
        // Ties go to the engine after the last one chosen, so equal engines share the load.
        let order: Vec<usize> = (0..n).map(|i| (self.next + i) % n).collect();
        let engine = match self.placement {
            Placement::Rr => order[0],
            Placement::LeastLoaded => *order.iter().min_by_key(|&&e| load[e]).unwrap_or(&0),
            Placement::Affinity => {
                let least = load.iter().copied().min().unwrap_or(0);
                let score = |e: usize| (run_of(e), std::cmp::Reverse(load[e]));
                let fits = |e: &usize| load[*e] <= least + self.load_bound;
                let best = order.iter().copied().filter(fits).map(score).max();
                order
                    .iter()
                    .copied()
                    .filter(fits)
                    .find(|&e| Some(score(e)) == best)
                    .unwrap_or(order[0])
            }
        };
        self.next = (engine + 1) % n;
        let own = self.cache_of[engine];
        let source = self
            .pulls
            .then(|| {
                (0..self.caches)
                    .filter(|&c| Some(c) != own)
                    .max_by_key(|&c| (runs[c], std::cmp::Reverse(c)))
            })
            .flatten()
            .filter(|&c| runs[c] > run_of(engine))
            .map(|c| (c, runs[c]));
        Decision { engine, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::config::Setup;
    use kvnode_engine::policy::PolicyKind;

    fn setup(placement: Placement) -> Setup {
        Setup {
            nodes: 2,
            engines_per_node: 2,
            dram_blocks: 8,
            gpu_blocks: 0,
            policy: PolicyKind::Lru,
            placement,
            load_bound: 1,
            block_bytes: 4096,
            touch_gpu_hits: true,
            announce_pulled: true,
        }
    }

    fn shared() -> Vec<Option<usize>> {
        vec![Some(0), Some(0), Some(1), Some(1)]
    }

    #[test]
    fn affinity_follows_the_prefix_within_the_load_bound() {
        let mut r = Router::new(&setup(Placement::Affinity), shared(), true);
        let mut ix = Index::default();
        for b in [1, 2, 3] {
            ix.stored(1, b);
        }
        let d = r.place(&[1, 2, 3, 4], &ix, &[0, 0, 0, 0]);
        assert_eq!((d.engine, d.source), (2, None));
        // Node 1's engines are over the bound: placed on node 0 with a hint to node 1.
        let d = r.place(&[1, 2, 3, 4], &ix, &[0, 0, 2, 2]);
        assert_eq!(d.source, Some((1, 3)));
        assert!(d.engine < 2);
    }

    #[test]
    fn round_robin_hints_the_node_with_the_longer_prefix() {
        let mut r = Router::new(&setup(Placement::Rr), shared(), true);
        let mut ix = Index::default();
        ix.stored(1, 7);
        let picks: Vec<Decision> = (0..4).map(|_| r.place(&[7], &ix, &[0; 4])).collect();
        assert_eq!(
            picks.iter().map(|d| d.engine).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(picks[0].source, Some((1, 1)));
        assert_eq!(picks[2].source, None, "its own node holds it");
        ix.removed(1, 7);
        assert_eq!(r.place(&[7], &ix, &[0; 4]).source, None);
    }
}
