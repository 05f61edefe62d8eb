//! `kvnode bench replay` flags and the plain setup both the live replay and its offline model
//! run from.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvnode_engine::policy::PolicyKind;

/// Tokens of one trace block, and of the modelled prefill per block.
pub use super::trace::TRACE_BLOCK_TOKENS;

/// Smallest DRAM tier a daemon accepts (`MIN_DRAM`): a daemon's block capacity times the
/// scaled block size must reach it.
const MIN_DAEMON_DRAM: u64 = kvnode_engine::config::MIN_DRAM;

/// What caches the engines have (the four arms of issue 40).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arm {
    /// Each engine's GPU prefix cache only; no daemon.
    Gpu,
    /// A private DRAM tier per engine: one daemon per engine holding the node's DRAM / E.
    Private,
    /// One kvnode daemon per node shared by its engines; no pulls between nodes.
    Shared,
    /// Node-shared daemons, and a `kv.fetch` hint to the node holding a longer prefix.
    Pulls,
}

/// How the router picks an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Round-robin over every engine of the fleet.
    Rr,
    /// The engine with the fewest requests in flight (ties: lowest rank).
    LeastLoaded,
    /// The longest prefix the KV events say a cache holds, among engines within
    /// `--load-bound` requests of the least loaded.
    Affinity,
}

/// When the pulls arm starts pulling a hinted prefix (`--prefetch-at`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefetchAt {
    /// When the engine schedules the request: its hinted get pulls (`kv.fetch`).
    #[default]
    Schedule,
    /// When the router places it: a signed `kv.prefetch` of the same source and hashes to the
    /// destination daemon's router entry starts the pull; the hinted get then joins it or hits.
    Placement,
}

/// A behaviour of today's daemons and engines that a run can leave out (`--without`), to
/// measure what it buys (docs/replay.md, "What limits pulls").
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Behaviour {
    /// Daemons announce the blocks they pull (KV events with the source's metadata), so the
    /// router sees them. A daemon always does when its events are on: only `--model` can
    /// leave it out.
    AnnouncePulled,
    /// Engines touch their GPU-cache hits in the node tier (the `Touch` op), so its policy
    /// keeps a hot prefix's leading blocks.
    TouchGpuHits,
}

/// `kvnode bench replay` flags.
#[derive(Debug, Args, Clone)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "command-line switches, each independent and documented"
)]
pub struct ReplayArgs {
    /// Trace in Mooncake's format (one JSON request a line; ../shared/traces/README.md).
    #[arg(long)]
    pub trace: PathBuf,
    /// Nodes: one daemon each (per engine in the private arm), on loopback.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Engine ranks per node, each a client of its node's daemon.
    #[arg(long, default_value_t = 1)]
    pub engines_per_node: usize,
    /// DRAM blocks per node (the private arm gives each engine this / engines-per-node).
    #[arg(long, default_value_t = 8000)]
    pub dram_blocks: usize,
    /// Blocks of each engine's GPU prefix cache (LRU); 0: none.
    #[arg(long, default_value_t = 0)]
    pub gpu_blocks: usize,
    /// Eviction policy of the daemons (config `eviction`: lru, s3fifo, or any policy the
    /// daemon's `PolicyKind` names).
    #[arg(long, default_value = "lru")]
    pub policy: String,
    /// Router placement.
    #[arg(long, value_enum, default_value = "rr")]
    pub placement: Placement,
    /// Trace time divided by this (the trace's timestamps, sped up).
    #[arg(long, default_value_t = 60.0)]
    pub speedup: f64,
    /// Replay only the first K requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Arms to run, comma separated, each on the same trace slice.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "pulls")]
    pub arm: Vec<Arm>,
    /// Requests in flight per engine (queued or being served); the router waits when the
    /// chosen engine is full.
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,
    /// Pulls arm: start the hinted pull when the router places the request (`placement`: a
    /// `kv.prefetch` action) or when the engine schedules it (`schedule`: the get's hint).
    #[arg(long, value_enum, default_value = "schedule")]
    pub prefetch_at: PrefetchAt,
    /// Timed mode: each engine holds each request for its MODELLED prefill (cost.rs) divided
    /// by `--speedup` before offloading, so requests queue under load; the run then reports
    /// the measured queue and get waits (docs/replay.md, "Prefetch at placement").
    #[arg(long, conflicts_with = "deterministic")]
    pub hold_prefill: bool,
    /// Affinity's load bound: candidates are within this many in-flight requests of the
    /// least loaded engine.
    #[arg(long, default_value_t = 2)]
    pub load_bound: usize,
    /// One request at a time in trace order, no clock, and the router waits for every
    /// daemon's KV events to arrive before placing the next request: the run is then a
    /// pure function of the trace and the flags (CI checks it against the offline model).
    #[arg(long)]
    pub deterministic: bool,
    /// Run the offline model of the deterministic replay instead of daemons (model.rs: the
    /// daemon's policy and its get/put/pull semantics; CI checks it equals the daemons).
    #[arg(long)]
    pub model: bool,
    /// Behaviours to leave out, comma separated, to measure what they buy
    /// (docs/replay.md, "What limits pulls"); `announce-pulled` needs `--model`.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub without: Vec<Behaviour>,
    /// Write the SVG chart here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print the JSON summary (one line per arm, then one for the run).
    #[arg(long)]
    pub json: bool,
    /// Bytes each trace block is stored as (`64KiB`, `1MiB`, ...): a multiple of 4 KiB, at
    /// least the automatic size. Default: the smallest multiple of 4 KiB with which every
    /// daemon reaches the daemon's minimum DRAM tier. Larger blocks make a pull of a prefix
    /// take longer on loopback (each daemon's DRAM is `--dram-blocks` x this).
    #[arg(long, value_parser = kvnode_proto::size::parse_size)]
    pub block_bytes: Option<u64>,
}

/// The run's fixed parameters, shared by the live replay and the model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Setup {
    /// Nodes.
    pub nodes: usize,
    /// Engines per node.
    pub engines_per_node: usize,
    /// DRAM blocks per node.
    pub dram_blocks: usize,
    /// GPU blocks per engine.
    pub gpu_blocks: usize,
    /// Daemon eviction policy.
    #[serde(serialize_with = "ser_policy")]
    pub policy: PolicyKind,
    /// Placement.
    pub placement: Placement,
    /// Affinity's load bound.
    pub load_bound: usize,
    /// Bytes one trace block is stored as (the scale).
    pub block_bytes: u64,
    /// Engines touch their GPU-cache hits in their node's tier.
    pub touch_gpu_hits: bool,
    /// Daemons announce the blocks they pull (always, live; `--model` can leave it out).
    pub announce_pulled: bool,
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's serialize_with passes a reference"
)]
fn ser_policy<S: serde::Serializer>(p: &PolicyKind, s: S) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(p, s)
}

/// Parses a policy name the way the daemon's config does.
pub fn parse_policy(name: &str) -> anyhow::Result<PolicyKind> {
    serde_json::from_value(serde_json::Value::String(name.to_owned())).with_context(|| {
        format!("--policy {name}: not an eviction policy of this daemon (config `eviction`)")
    })
}

impl Setup {
    /// The setup of `a`; the block size is the smallest multiple of 4 KiB with which every
    /// daemon of `arms` reaches the daemon's minimum DRAM tier.
    pub fn of(a: &ReplayArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(a.nodes >= 1, "--nodes must be at least 1");
        anyhow::ensure!(
            a.engines_per_node >= 1,
            "--engines-per-node must be at least 1"
        );
        anyhow::ensure!(
            a.dram_blocks >= a.engines_per_node,
            "--dram-blocks {} leaves no block for each of {} engines' private tier",
            a.dram_blocks,
            a.engines_per_node
        );
        let smallest = if a.arm.contains(&Arm::Private) {
            a.dram_blocks / a.engines_per_node
        } else {
            a.dram_blocks
        };
        anyhow::ensure!(
            a.model || !a.without.contains(&Behaviour::AnnouncePulled),
            "--without announce-pulled needs --model: a daemon with KV events always announces what it pulls"
        );
        let auto = block_bytes(smallest as u64);
        if let Some(b) = a.block_bytes {
            anyhow::ensure!(
                b >= auto && b.is_multiple_of(4096),
                "--block-bytes {b}: give a multiple of 4096 of at least {auto} (with {smallest} blocks per daemon, smaller blocks leave a daemon under its minimum DRAM tier)"
            );
        }
        Ok(Self {
            nodes: a.nodes,
            engines_per_node: a.engines_per_node,
            dram_blocks: a.dram_blocks,
            gpu_blocks: a.gpu_blocks,
            policy: parse_policy(&a.policy)?,
            placement: a.placement,
            load_bound: a.load_bound,
            block_bytes: a.block_bytes.unwrap_or(auto),
            touch_gpu_hits: !a.without.contains(&Behaviour::TouchGpuHits),
            announce_pulled: !a.without.contains(&Behaviour::AnnouncePulled),
        })
    }

    /// Engines in the fleet.
    pub fn engines(&self) -> usize {
        self.nodes * self.engines_per_node
    }

    /// Caches (daemons) of `arm` and the DRAM blocks of each; none for the GPU arm.
    pub fn caches(&self, arm: Arm) -> (usize, usize) {
        match arm {
            Arm::Gpu => (0, 0),
            Arm::Private => (self.engines(), self.dram_blocks / self.engines_per_node),
            Arm::Shared | Arm::Pulls => (self.nodes, self.dram_blocks),
        }
    }

    /// The cache (daemon) engine `e` uses in `arm`.
    pub fn cache_of(&self, arm: Arm, e: usize) -> Option<usize> {
        match arm {
            Arm::Gpu => None,
            Arm::Private => Some(e),
            Arm::Shared | Arm::Pulls => Some(e / self.engines_per_node),
        }
    }
}

/// Smallest multiple of 4 KiB with which `blocks` blocks fill the daemon's minimum DRAM.
fn block_bytes(blocks: u64) -> u64 {
    let need = MIN_DAEMON_DRAM.div_ceil(blocks.max(1));
    need.div_ceil(4096).max(1) * 4096
}

/// The slab size for `blocks` blocks of `block` bytes: `block` times the largest divisor of
/// `blocks` up to 256, so the tier holds exactly `blocks` slots of one class.
pub fn slab_bytes(blocks: u64, block: u64) -> u64 {
    let per = (1..=256.min(blocks))
        .rev()
        .find(|d| blocks.is_multiple_of(*d))
        .unwrap_or(1);
    per * block
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_reach_the_minimum_dram_and_slabs_divide_it() {
        for blocks in [1000u64, 2000, 4000, 8000, 16_000, 32_000, 4001] {
            let b = block_bytes(blocks);
            assert!(
                b * blocks >= MIN_DAEMON_DRAM && b.is_multiple_of(4096),
                "{blocks}"
            );
            assert_eq!(blocks * b % slab_bytes(blocks, b), 0, "{blocks}");
        }
        assert_eq!(block_bytes(32_000), 4096);
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: ReplayArgs,
    }

    #[test]
    fn prefetch_at_and_hold_prefill_parse() {
        use clap::Parser;
        let a = Cli::try_parse_from(["x", "--trace", "t"]).unwrap().a;
        assert_eq!(a.prefetch_at, PrefetchAt::Schedule);
        assert!(!a.hold_prefill);
        let a = Cli::try_parse_from([
            "x",
            "--trace",
            "t",
            "--prefetch-at",
            "placement",
            "--hold-prefill",
        ])
        .unwrap()
        .a;
        assert_eq!(a.prefetch_at, PrefetchAt::Placement);
        assert!(a.hold_prefill);
        assert!(Cli::try_parse_from(["x", "--trace", "t", "--prefetch-at", "arrival"]).is_err());
        assert_eq!(a.block_bytes, None);
        assert!(
            Cli::try_parse_from(["x", "--trace", "t", "--hold-prefill", "--deterministic"])
                .is_err()
        );
    }

    #[test]
    fn block_bytes_are_a_size_at_least_the_automatic_one() {
        use clap::Parser;
        let of = |b: &str| {
            let a = Cli::try_parse_from([
                "x",
                "--trace",
                "t",
                "--dram-blocks",
                "32000",
                "--block-bytes",
                b,
            ])
            .unwrap()
            .a;
            Setup::of(&a).map(|s| s.block_bytes)
        };
        assert_eq!(of("64KiB").unwrap(), 64 << 10);
        assert!(of("4096").is_ok());
        assert!(of("6000").is_err(), "not a multiple of 4 KiB");
        let small = Cli::try_parse_from([
            "x",
            "--trace",
            "t",
            "--dram-blocks",
            "2000",
            "--block-bytes",
            "4KiB",
        ])
        .unwrap()
        .a;
        assert!(
            Setup::of(&small).is_err(),
            "under the daemon's minimum DRAM"
        );
        assert!(Cli::try_parse_from(["x", "--trace", "t", "--block-bytes", "lots"]).is_err());
    }

    #[test]
    fn policy_names_parse_like_the_config() {
        assert_eq!(parse_policy("s3fifo").unwrap(), PolicyKind::S3fifo);
        assert!(parse_policy("mru").is_err());
    }
}
