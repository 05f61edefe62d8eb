//! The offline model of a deterministic replay: the same trace, router, GPU caches and
//! placement, with each daemon's DRAM tier replaced by the daemon's own eviction policy over
//! a set of slots, doing what the daemon does on each call of the replay:
//!
//! - a get leases (and so touches) every key it holds, in key order, as one batch of the held
//!   keys;
//! - with a hint, it first pulls the covered keys it lacks: the source leases (touches) them,
//!   the destination stores them unannounced (no KV event; pulled blocks carry no tokens);
//! - a put stores each key it lacks (evicting the policy's victim when full, which announces
//!   the victim's removal if it was announced) and leaves keys it holds untouched; it goes in
//!   ops of `PUT_KEYS` keys, each reserving its slots before committing them (tier.rs).
//!
//! CI replays a slice against real daemons and checks their counts equal this model's.

use std::collections::HashSet;

use kvnode_engine::policy::BatchHint;

use super::blocks::GpuCache;
use super::config::{Arm, Setup};
use super::engine::Served;
use super::router::{Index, Router};
use super::tier::{PUT_KEYS, Tier};
use super::trace::Request;

/// One daemon's DRAM tier, modelled ([`Tier`]), and which of its blocks it announced.
#[derive(Debug)]
struct Dram {
    tier: Tier,
    announced: HashSet<u64>,
}

impl Dram {
    fn new(setup: &Setup, blocks: usize) -> Self {
        Self {
            tier: Tier::new(setup.policy, blocks),
            announced: HashSet::new(),
        }
    }

    fn holds(&self, b: u64) -> bool {
        self.tier.holds(b)
    }

    /// Reads `b` if held; `hint` is its place in the daemon's batch.
    fn touch(&mut self, b: u64, hint: BatchHint) {
        self.tier.touch(b, hint);
    }

    /// One put op of `blocks` (each announced when `announce`); returns how many it stored.
    /// A victim's removal is announced if the victim was.
    fn put_op(&mut self, ix: &mut Index, c: usize, blocks: &[u64], announce: bool) -> u64 {
        let announced = &mut self.announced;
        let stored = self.tier.put_op(blocks, |old| {
            if announced.remove(&old) {
                ix.removed(c, old);
            }
        });
        let mut n = 0;
        for (&b, s) in blocks.iter().zip(stored) {
            if s {
                n += 1;
                if announce {
                    self.announced.insert(b);
                    ix.stored(c, b);
                }
            }
        }
        n
    }

    /// A put of `blocks` as the replay's engines send it (ops of [`PUT_KEYS`] keys).
    fn put(&mut self, ix: &mut Index, c: usize, blocks: &[u64]) -> u64 {
        blocks
            .chunks(PUT_KEYS)
            .map(|op| self.put_op(ix, c, op, true))
            .sum()
    }
}

/// The model of one arm.
#[derive(Debug)]
pub struct Model {
    setup: Setup,
    arm: Arm,
    gpus: Vec<GpuCache>,
    drams: Vec<Dram>,
    index: Index,
}

impl Model {
    /// A fresh fleet of `arm`.
    pub fn new(setup: &Setup, arm: Arm) -> Self {
        let (n, blocks) = setup.caches(arm);
        Self {
            setup: setup.clone(),
            arm,
            gpus: (0..setup.engines())
                .map(|_| GpuCache::new(setup.gpu_blocks))
                .collect(),
            drams: (0..n).map(|_| Dram::new(setup, blocks)).collect(),
            index: Index::default(),
        }
    }

    /// The router's view (exact here: what every daemon announced).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Serves `r` on `engine`, with a hint to `source` covering its leading blocks.
    pub fn serve(&mut self, engine: usize, r: &Request, source: Option<(usize, usize)>) -> Served {
        let g = self.gpus[engine].leading(&r.blocks);
        let mut s = Served {
            refs: r.blocks.len() as u64,
            gpu: g as u64,
            ..Served::default()
        };
        let rest = &r.blocks[g..];
        if let Some(c) = self.setup.cache_of(self.arm, engine)
            && !rest.is_empty()
        {
            // The engine touches its GPU hits before its get (and the get's pull).
            // `Touch` refreshes the leading run the node holds, each at its place in it.
            if self.setup.touch_gpu_hits {
                let d = &mut self.drams[c];
                for (i, &b) in r.blocks[..g].iter().enumerate() {
                    if !d.holds(b) {
                        break;
                    }
                    d.touch(b, BatchHint::at(i, g));
                }
            }
            let covered = source.map_or(0, |(_, n)| n.saturating_sub(g));
            let pulled = self.pull(c, source.map(|(b, _)| b), &rest[..covered]);
            let d = &mut self.drams[c];
            d.tier.lease(rest);
            let lead = rest.iter().take_while(|&&b| d.holds(b)).count();
            s.peer = rest[..lead].iter().filter(|b| pulled.contains(b)).count() as u64;
            s.dram = lead as u64 - s.peer;
            s.stored = d.put(&mut self.index, c, &rest[lead..]);
        }
        s.computed = s.refs - s.gpu - s.dram - s.peer;
        self.gpus[engine].admit(&r.blocks);
        s
    }

    /// The hinted pull into cache `c` from `src`: returns the blocks pulled.
    fn pull(&mut self, c: usize, src: Option<usize>, covered: &[u64]) -> Vec<u64> {
        let Some(src) = src else { return Vec::new() };
        let want: Vec<u64> = covered
            .iter()
            .copied()
            .filter(|&b| !self.drams[c].holds(b))
            .collect();
        let got: Vec<u64> = want
            .into_iter()
            .filter(|&b| self.drams[src].holds(b))
            .collect();
        for (i, &b) in got.iter().enumerate() {
            self.drams[src].touch(b, BatchHint::at(i, got.len()));
        }
        // The destination reserves and commits each pulled block on its own (peer/fetch.rs).
        let announce = self.setup.announce_pulled;
        for &b in &got {
            self.drams[c].put_op(&mut self.index, c, &[b], announce);
        }
        got
    }
}

/// Runs the model of a deterministic replay of `trace` in `arm`: per request, its engine and
/// where its blocks came from.
pub fn run(setup: &Setup, arm: Arm, trace: &[Request]) -> Vec<(usize, Served)> {
    let mut m = Model::new(setup, arm);
    let cache_of = (0..setup.engines())
        .map(|e| setup.cache_of(arm, e))
        .collect();
    let mut router = Router::new(setup, cache_of, arm == Arm::Pulls);
    let idle = vec![0; setup.engines()];
    trace
        .iter()
        .map(|r| {
            let d = router.place(&r.blocks, m.index(), &idle);
            (d.engine, m.serve(d.engine, r, d.source))
        })
        .collect()
}
