//! `kvnode bench evict`: offline hit rates of the daemon's eviction policies on a trace, next to
//! Belady's MIN and the infinite-cache ceiling at the same capacity (docs/eviction.md).
//!
//! It runs the policy code the DRAM tier runs, fed what the tier feeds it
//! ([`crate::replay::offline::simulate`]); no daemon is started. Each trace is measured whole
//! and split at the middle of its time span: the first half is the part the `chain` policy was
//! tuned on, the second half was kept out of the tuning (its cache starts empty).
//!
//! ```text
//! kvnode bench evict --trace ../shared/traces/mooncake_fast25/conversation_trace.jsonl \
//!     --capacity 2000,8000,32000
//! ```

use std::path::PathBuf;

use clap::Args;
use kvnode_engine::policy::PolicyKind;
use serde::Serialize;

use crate::replay::offline::{belady, ceiling, count_oracle, reuse_oracle, simulate};
use crate::replay::trace::{self, Request};

/// `kvnode bench evict` flags.
#[derive(Debug, Args)]
pub struct EvictArgs {
    /// Trace files in Mooncake's format (one JSON request a line); repeat for several.
    #[arg(long, required = true)]
    pub trace: Vec<PathBuf>,
    /// Capacities in blocks.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,2000,4000,8000,16000,32000"
    )]
    pub capacity: Vec<usize>,
    /// Print one JSON line per row as well.
    #[arg(long)]
    pub json: bool,
}

/// Which part of a trace a row measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Part {
    /// The whole trace.
    Whole,
    /// Requests in the first half of the time span (the tuning part).
    Tuning,
    /// Requests in the second half (held out of the tuning).
    HeldOut,
}

impl Part {
    /// The requests of `trace` in this part.
    pub fn select(self, trace: &[Request]) -> Vec<Request> {
        let mid = trace.iter().map(|r| r.at_ms).max().unwrap_or(0) / 2;
        trace
            .iter()
            .filter(|r| match self {
                Part::Whole => true,
                Part::Tuning => r.at_ms < mid,
                Part::HeldOut => r.at_ms >= mid,
            })
            .cloned()
            .collect()
    }
}

/// Hit rates of one trace part at one capacity.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Trace file name.
    pub trace: String,
    /// Part of it.
    pub part: Part,
    /// Blocks cached.
    pub capacity: usize,
    /// LRU.
    pub lru: f64,
    /// S3-FIFO.
    pub s3fifo: f64,
    /// `chain`.
    pub chain: f64,
    /// Belady's MIN.
    pub belady: f64,
    /// An oracle that knows which blocks come back (not when): LRU over those
    /// ([`reuse_oracle`]).
    pub reuse_oracle: f64,
    /// An oracle that knows how many more times each block is used (not when)
    /// ([`count_oracle`]).
    pub count_oracle: f64,
    /// Infinite cache.
    pub ceiling: f64,
}

impl Row {
    /// Measures `requests` at `capacity`.
    pub fn measure(name: &str, part: Part, requests: &[Request], capacity: usize) -> Self {
        let rate = |kind| simulate(requests, capacity, kind).hit_rate();
        Self {
            trace: name.to_string(),
            part,
            capacity,
            lru: rate(PolicyKind::Lru),
            s3fifo: rate(PolicyKind::S3fifo),
            chain: rate(PolicyKind::Chain),
            belady: belady(requests, capacity).hit_rate(),
            reuse_oracle: reuse_oracle(requests, capacity).hit_rate(),
            count_oracle: count_oracle(requests, capacity).hit_rate(),
            ceiling: ceiling(requests).hit_rate(),
        }
    }

    /// `chain` over MIN (0 when MIN hits nothing).
    pub fn chain_over_min(&self) -> f64 {
        share(self.chain, self.belady)
    }
}

/// `part` over `whole` (0 when `whole` is 0).
fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 { part / whole } else { 0.0 }
}

/// Runs `kvnode bench evict`.
pub fn run(a: &EvictArgs) -> anyhow::Result<()> {
    println!(
        "| trace | part | requests | blocks cached | LRU | S3-FIFO | chain | reuse oracle | count oracle | MIN | ceiling | chain / MIN | count oracle / MIN |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for path in &a.trace {
        let all = trace::load(path, None)?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        for part in [Part::Whole, Part::Tuning, Part::HeldOut] {
            let requests = part.select(&all);
            for &capacity in &a.capacity {
                let r = Row::measure(&name, part, &requests, capacity);
                println!(
                    "| {} | {:?} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
                    r.trace,
                    r.part,
                    requests.len(),
                    r.capacity,
                    r.lru,
                    r.s3fifo,
                    r.chain,
                    r.reuse_oracle,
                    r.count_oracle,
                    r.belady,
                    r.ceiling,
                    r.chain_over_min(),
                    share(r.count_oracle, r.belady)
                );
                if a.json {
                    println!("{}", serde_json::to_string(&r)?);
                }
            }
        }
    }
    Ok(())
}

/// On the real Mooncake traces (`../shared/traces`, read through [`trace::traces_dir`]), with the
/// policy called in the daemon's order ([`simulate`]): `chain` is never below LRU on the whole
/// traces, the tuning half or the half kept out of its tuning at 500–64,000 blocks (but the
/// three rows docs/eviction.md names), gains where DRAM is short, and keeps the fraction of
/// Belady's MIN that docs/eviction.md reports. Run:
/// `cargo test --release -p kvnode-bench evict`. A missing
/// trace fails the test unless `KVNODE_TEST_ALLOW_SKIP` lists `traces` (or `all`).
#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The traces, or `None` when they are missing and the skip is allowed (panics otherwise).
    fn traces() -> Option<Vec<(&'static str, Vec<Request>)>> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = trace::traces_dir(&root).map(|d| d.join("mooncake_fast25"));
        let load = |name: &str| {
            let path = dir.as_ref()?.join(format!("{name}_trace.jsonl"));
            trace::load(&path, None).ok()
        };
        if let (Some(c), Some(s)) = (load("conversation"), load("synthetic")) {
            return Some(vec![("conversation", c), ("synthetic", s)]);
        }
        let allowed = std::env::var("KVNODE_TEST_ALLOW_SKIP").unwrap_or_default();
        assert!(
            allowed
                .split(',')
                .any(|w| w.trim() == "traces" || w.trim() == "all"),
            "the Mooncake traces are missing: put them in ../shared/traces/mooncake_fast25 \
             beside the repository or point KVNODE_TRACES at a copy (see \
             ../shared/traces/README.md), or set KVNODE_TEST_ALLOW_SKIP=traces to skip on purpose"
        );
        eprintln!(
            "\n!!!!! SKIPPING (KVNODE_TEST_ALLOW_SKIP={allowed}): no Mooncake traces !!!!!\n"
        );
        None
    }

    /// The capacities of docs/eviction.md's tables (issue 40's and more), for both traces.
    const CAPACITIES: [usize; 8] = [500, 1000, 2000, 4000, 8000, 16000, 32000, 64000];

    /// Rows where `chain` is below LRU, as docs/eviction.md reports them: the synthetic trace's
    /// tuning half at 2,000 blocks (0.034 against 0.039: three requests whose prefix came back
    /// 1,054–1,928 blocks later, inside LRU's 2,000 but behind blocks that `chain` keeps for
    /// their reuse), and the conversation trace at 64,000 blocks, whole and tuning half (0.0008
    /// and 0.0003 below: equal to the third digit). Listed so that any other row falling below
    /// LRU, or one of these rising, fails.
    const KNOWN_BELOW: [(&str, Part, usize); 3] = [
        ("synthetic", Part::Tuning, 2000),
        ("conversation", Part::Whole, 64000),
        ("conversation", Part::Tuning, 64000),
    ];

    #[test]
    fn chain_is_never_below_lru_on_any_part_at_any_capacity_but_the_known_row() {
        let Some(traces) = traces() else { return };
        let mut below = Vec::new();
        for (name, all) in &traces {
            for part in [Part::Whole, Part::Tuning, Part::HeldOut] {
                let requests = part.select(all);
                for c in CAPACITIES {
                    let lru = simulate(&requests, c, PolicyKind::Lru).hits;
                    let chain = simulate(&requests, c, PolicyKind::Chain).hits;
                    if chain < lru {
                        below.push((*name, part, c, format!("chain {chain} < LRU {lru} hits")));
                    }
                }
            }
        }
        let unknown: Vec<_> = below
            .iter()
            .filter(|(n, p, c, _)| !KNOWN_BELOW.contains(&(*n, *p, *c)))
            .collect();
        assert!(unknown.is_empty(), "chain below LRU: {unknown:#?}");
        let risen: Vec<_> = KNOWN_BELOW
            .iter()
            .filter(|k| !below.iter().any(|(n, p, c, _)| (*n, *p, *c) == **k))
            .collect();
        assert!(
            risen.is_empty(),
            "no longer below LRU (update KNOWN_BELOW and docs/eviction.md): {risen:?}"
        );
    }

    /// docs/eviction.md, "What knowing more would reach": at synthetic 1,000 blocks even an
    /// oracle that knows every block's future use count stays below 0.6 × MIN (what limits
    /// that row is knowing *when* a block returns), and at conversation 8,000 one that knows
    /// only *whether* a block returns reaches MIN. On every part and capacity of the tables,
    /// `chain` ≤ reuse oracle ≤ count oracle ≤ MIN.
    #[test]
    fn the_oracles_show_what_each_row_lacks() {
        let Some(traces) = traces() else { return };
        let trace = |name: &str| &traces.iter().find(|(n, _)| *n == name).expect("loaded").1;
        let (syn, conv) = (trace("synthetic"), trace("conversation"));
        let count = count_oracle(syn, 1000).hit_rate();
        let min = belady(syn, 1000).hit_rate();
        assert!(
            (0.5..0.6).contains(&(count / min)),
            "synthetic 1,000: count oracle {count:.3}, MIN {min:.3}"
        );
        let reuse = reuse_oracle(conv, 8000).hit_rate();
        let min = belady(conv, 8000).hit_rate();
        assert!(
            reuse >= 0.999 * min,
            "conversation 8,000: reuse oracle {reuse:.4}, MIN {min:.4}"
        );
        let mut out_of_order = Vec::new();
        for (name, all) in &traces {
            for part in [Part::Whole, Part::Tuning, Part::HeldOut] {
                let requests = part.select(all);
                for c in CAPACITIES {
                    let hits = [
                        simulate(&requests, c, PolicyKind::Chain).hits,
                        reuse_oracle(&requests, c).hits,
                        count_oracle(&requests, c).hits,
                        belady(&requests, c).hits,
                    ];
                    if hits.windows(2).any(|w| w[0] > w[1]) {
                        out_of_order.push(format!("{name} {part:?} {c}: {hits:?}"));
                    }
                }
            }
        }
        assert!(
            out_of_order.is_empty(),
            "chain ≤ reuse ≤ count ≤ MIN broken: {out_of_order:#?}"
        );
    }

    #[test]
    fn chain_gains_on_lru_and_keeps_its_share_of_min_at_the_issues_capacities() {
        let Some(traces) = traces() else { return };
        // (trace, capacity, least gain over LRU, least chain / MIN): docs/eviction.md's table
        // of the whole traces, rounded down.
        let rows = [
            ("conversation", 2000, 0.02, 0.29),
            ("conversation", 8000, 0.02, 0.54),
            ("conversation", 32000, 0.001, 0.91),
            ("synthetic", 1000, 0.004, 0.31),
            ("synthetic", 4000, 0.014, 0.49),
            ("synthetic", 16000, 0.014, 0.85),
        ];
        let mut short = Vec::new();
        for (name, c, gain, share) in rows {
            let requests = &traces.iter().find(|(n, _)| *n == name).expect("loaded").1;
            let lru = simulate(requests, c, PolicyKind::Lru).hit_rate();
            let chain = simulate(requests, c, PolicyKind::Chain).hit_rate();
            let min = belady(requests, c).hit_rate();
            if chain < lru + gain || chain < share * min {
                short.push(format!(
                    "{name} {c}: chain {chain:.3}, LRU {lru:.3} (+{gain} wanted), MIN {min:.3} (×{share} wanted)"
                ));
            }
        }
        assert!(short.is_empty(), "{short:#?}");
    }
}
