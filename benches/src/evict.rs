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

use crate::replay::offline::{belady, ceiling, simulate};
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
            ceiling: ceiling(requests).hit_rate(),
        }
    }

    /// `chain` over MIN (0 when MIN hits nothing).
    pub fn chain_over_min(&self) -> f64 {
        if self.belady > 0.0 {
            self.chain / self.belady
        } else {
            0.0
        }
    }
}

/// Runs `kvnode bench evict`.
pub fn run(a: &EvictArgs) -> anyhow::Result<()> {
    println!(
        "| trace | part | requests | blocks cached | LRU | S3-FIFO | chain | MIN | ceiling | chain / MIN |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
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
                    "| {} | {:?} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
                    r.trace,
                    r.part,
                    requests.len(),
                    r.capacity,
                    r.lru,
                    r.s3fifo,
                    r.chain,
                    r.belady,
                    r.ceiling,
                    r.chain_over_min()
                );
                if a.json {
                    println!("{}", serde_json::to_string(&r)?);
                }
            }
        }
    }
    Ok(())
}
