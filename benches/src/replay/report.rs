//! The replay's figures: hit rates by tier (exact: summed from the daemons' per-request
//! answers), the offline optimum beside them, bytes moved, the daemons' own counters, the
//! modelled TTFT and throughput (labelled as a model), as JSON and as a text table.

use std::fmt::Write;

use kvnode_proto::stats::{RouterStats, TierStats};

use super::config::{Arm, Setup};
use super::cost::CostModel;
use super::drive::Record;
use super::engine::Served;
use super::trace::Request;

/// Offline figures of the same trace slice.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Offline {
    /// Infinite-cache hit rate.
    pub ceiling: f64,
    /// Belady's MIN with the fleet's DRAM as one cache.
    pub belady_hit_rate: f64,
    /// Blocks of that cache.
    pub belady_blocks: usize,
    /// The daemon's policy, offline, one cache of one node's DRAM blocks.
    pub policy_hit_rate: f64,
}

/// Daemon counters summed over the arm's daemons (DRAM tier), and each daemon's router entry.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DaemonCounters {
    /// Keys found by gets.
    pub hits: u64,
    /// Keys not found.
    pub misses: u64,
    /// Blocks stored (offloads and pulls).
    pub inserts: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Pulls arm: each daemon's router-entry counters (requests it accepted or refused, and
    /// the router hashes peers asked it to resolve), in daemon order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub router: Vec<RouterStats>,
}

impl DaemonCounters {
    /// Adds one daemon's DRAM tier.
    pub fn add(&mut self, t: &TierStats) {
        self.hits += t.hits;
        self.misses += t.misses;
        self.inserts += t.inserts;
        self.evictions += t.evictions;
    }

    /// One line per daemon with its router-entry counters (none outside the pulls arm).
    pub fn router_lines(&self) -> String {
        let mut s = String::new();
        for (i, r) in self.router.iter().enumerate() {
            let _ = writeln!(
                s,
                "router entry, daemon {i}: serving {}, accepted {}, refused auth {} / replay {} / invalid {}; as a source: resolve asked {}, found {}",
                r.serving,
                r.accepted,
                r.refused_auth,
                r.refused_replay,
                r.refused_invalid,
                r.resolve_asked,
                r.resolve_found
            );
        }
        s
    }
}

/// Percentiles of the modelled TTFT, ms.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Ttft {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

/// One arm's summary (`--json`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ArmSummary {
    /// Arm.
    pub arm: Arm,
    /// Requests replayed.
    pub requests: usize,
    /// Block references.
    pub refs: u64,
    /// Blocks by source, summed over the requests (exact counts behind the rates).
    pub blocks: Served,
    /// Blocks served from any cache over references.
    pub hit_rate: f64,
    /// Per tier: GPU, node DRAM, peer; and recomputed.
    pub hit_rate_gpu: f64,
    /// Node DRAM share.
    pub hit_rate_dram: f64,
    /// Peer share.
    pub hit_rate_peer: f64,
    /// Recomputed share.
    pub computed_rate: f64,
    /// Offline figures.
    #[serde(flatten)]
    pub offline: Offline,
    /// hit_rate / ceiling.
    pub of_ceiling: f64,
    /// Bytes read from daemons (DRAM and pulled), at the replay's block size.
    pub bytes_read: u64,
    /// Bytes pulled between nodes, at the replay's block size.
    pub bytes_pulled: u64,
    /// Blocks the daemons stored on offload.
    pub blocks_offloaded: u64,
    /// The daemons' counters.
    pub daemon: DaemonCounters,
    /// Measured in this run: µs per block of gets without a pull, and of gets with one.
    pub get_us_per_block: f64,
    /// Measured: µs per block of hinted gets.
    pub pulled_get_us_per_block: f64,
    /// MODELLED TTFT (cost.rs), ms.
    pub ttft_model_ms: Ttft,
    /// MODELLED prefill-only throughput: requests / the busiest engine's modelled seconds.
    pub throughput_model_rps: f64,
    /// Wall seconds of the replay.
    pub wall_s: f64,
    /// With `--hold-prefill`: the measured queue and get waits (waits.rs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waits: Option<super::waits::Waits>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Totals of the served blocks.
pub fn total(recs: &[Record]) -> Served {
    recs.iter().fold(Served::default(), |mut t, r| {
        t.refs += r.served.refs;
        t.gpu += r.served.gpu;
        t.dram += r.served.dram;
        t.peer += r.served.peer;
        t.computed += r.served.computed;
        t.stored += r.served.stored;
        t
    })
}

/// What one arm's summary is made from.
#[derive(Debug)]
pub struct ArmRun<'a> {
    /// Setup.
    pub setup: &'a Setup,
    /// Arm.
    pub arm: Arm,
    /// Trace slice.
    pub trace: &'a [Request],
    /// Per request.
    pub recs: &'a [Record],
    /// Offline figures.
    pub offline: Offline,
    /// Daemon counters.
    pub daemon: DaemonCounters,
    /// Wall seconds.
    pub wall_s: f64,
}

/// Builds an arm's summary.
pub fn summarize(run: &ArmRun<'_>, cost: &CostModel) -> ArmSummary {
    let t = total(run.recs);
    let hits = t.gpu + t.dram + t.peer;
    let mut ttft: Vec<f64> = run
        .trace
        .iter()
        .zip(run.recs)
        .map(|(r, rec)| cost.ttft_ms(r, &rec.served))
        .collect();
    let mut busy = vec![0.0f64; run.setup.engines()];
    for (ms, rec) in ttft.iter().zip(run.recs) {
        busy[rec.engine] += ms / 1e3;
    }
    let busiest = busy.iter().copied().fold(0.0, f64::max);
    let mean = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
    ttft.sort_by(f64::total_cmp);
    let per_block = |pulled: bool| {
        let (s, b) = run
            .recs
            .iter()
            .filter(|r| r.timing.pulled == pulled && r.timing.get_s > 0.0)
            .fold((0.0, 0u64), |(s, b), r| {
                (s + r.timing.get_s, b + r.served.refs - r.served.gpu)
            });
        if b == 0 { 0.0 } else { s / b as f64 * 1e6 }
    };
    let block = run.setup.block_bytes;
    ArmSummary {
        arm: run.arm,
        requests: run.recs.len(),
        refs: t.refs,
        blocks: t,
        hit_rate: ratio(hits, t.refs),
        hit_rate_gpu: ratio(t.gpu, t.refs),
        hit_rate_dram: ratio(t.dram, t.refs),
        hit_rate_peer: ratio(t.peer, t.refs),
        computed_rate: ratio(t.computed, t.refs),
        offline: run.offline,
        of_ceiling: if run.offline.ceiling > 0.0 {
            ratio(hits, t.refs) / run.offline.ceiling
        } else {
            0.0
        },
        bytes_read: (t.dram + t.peer) * block,
        bytes_pulled: t.peer * block,
        blocks_offloaded: t.stored,
        daemon: run.daemon.clone(),
        get_us_per_block: per_block(false),
        pulled_get_us_per_block: per_block(true),
        ttft_model_ms: Ttft {
            p50: percentile(&ttft, 0.5),
            p90: percentile(&ttft, 0.9),
            p99: percentile(&ttft, 0.99),
            mean,
        },
        throughput_model_rps: if busiest > 0.0 {
            run.recs.len() as f64 / busiest
        } else {
            0.0
        },
        wall_s: run.wall_s,
        waits: None,
    }
}

/// The text table of a run's arms.
pub fn table(arms: &[ArmSummary]) -> String {
    let mut s = String::from(
        "| arm | hit rate | GPU | DRAM | peer | ceiling | of ceiling | Belady (blocks) | offline policy | pulled MB | TTFT model p50 / p90 / p99 ms | model req/s | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for a in arms {
        let _ = writeln!(
            s,
            "| {:?} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.3} ({}) | {:.3} | {:.1} | {:.0} / {:.0} / {:.0} | {:.1} | {:.1} |",
            a.arm,
            a.hit_rate,
            a.hit_rate_gpu,
            a.hit_rate_dram,
            a.hit_rate_peer,
            a.offline.ceiling,
            a.of_ceiling,
            a.offline.belady_hit_rate,
            a.offline.belady_blocks,
            a.offline.policy_hit_rate,
            a.bytes_pulled as f64 / 1e6,
            a.ttft_model_ms.p50,
            a.ttft_model_ms.p90,
            a.ttft_model_ms.p99,
            a.throughput_model_rps,
            a.wall_s,
        );
    }
    s
}
