//! `kvnode bench ...` arguments.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

/// The daemon socket a benchmark talks to.
#[derive(Debug, Args, Clone)]
pub struct SocketArg {
    /// Unix socket path (default: $XDG_RUNTIME_DIR/kvnode/kvnode.sock or /run/kvnode/kvnode.sock).
    #[arg(long, env = "KVNODE_SOCKET")]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    /// The socket path in force.
    pub fn path(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(kvnode_engine::config::default_socket)
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Load against a running daemon on this node; compares with memcpy measured in the same run.
    Local(BenchArgs),
    /// Demotion and promotion through a daemon it starts, next to fio on the same dir.
    Spill(BenchSpillArgs),
    /// Daemon-driven GPU offload/onload next to plain pinned cuMemcpy (needs a CUDA GPU).
    Gpu(GpuBenchArgs),
    /// KV events received by a live ZMQ subscriber while a daemon it starts serves puts.
    Events(crate::events::EventsArgs),
    /// Two daemons on loopback: peer pull throughput and latency next to iperf3 in the same run.
    Pull(crate::pull::PullArgs),
    /// First hit after a restart (takeover, SIGKILL, SIGTERM) of a daemon it starts.
    Restart(crate::restart::RestartArgs),
    /// Puts offered faster than the disk (2 × fio write) through a daemon it starts: no
    /// refusal, put throughput vs the same-run fio write.
    Backpressure(BackpressureArgs),
    /// Offline hit rates of the eviction policies on a trace, next to Belady's MIN and the
    /// infinite-cache ceiling (no daemon; docs/eviction.md).
    Evict(crate::evict::EvictArgs),
    /// A production trace (Mooncake format) through daemons it starts: hit rates by tier
    /// against Belady's MIN and the ceiling, for engine-private, node-shared and pulling arms.
    Replay(crate::replay::ReplayArgs),
    /// Clients issuing requests to a running daemon until a file appears (a takeover's
    /// hand-over record), and the service gap they saw.
    Load(crate::load::LoadArgs),
}

#[derive(Debug, Args)]
pub struct BenchSpillArgs {
    /// Working directory (spill file, fio file, daemon log); on the device to measure.
    #[arg(long, default_value = "/var/tmp/kvnode-bench-spill")]
    pub dir: PathBuf,
    /// Block size (also fio --bs).
    #[arg(long, default_value = "1MiB")]
    pub bs: String,
    /// Queue depth: daemon demotions in flight and fio --iodepth.
    #[arg(long, default_value_t = 8)]
    pub qd: usize,
    /// Bytes put through the daemon (and fio --size).
    #[arg(long, default_value = "2GiB")]
    pub size: String,
    /// DRAM tier of the daemon.
    #[arg(long, default_value = "256MiB")]
    pub dram: String,
}

#[derive(Debug, Args)]
pub struct GpuBenchArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: u32,
    /// Page sizes to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1MiB,2MiB,4MiB,8MiB,16MiB"
    )]
    pub sizes: Vec<String>,
    /// Bytes moved per request (pages per request = this / page size).
    #[arg(long, default_value = "64MiB")]
    pub batch_bytes: String,
    /// GPU buffer per page size (and the pinned buffer of the baseline).
    #[arg(long, default_value = "1GiB")]
    pub gpu_buffer: String,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Seconds to wait for the daemon to finish registering its arena.
    #[arg(long, default_value_t = 120)]
    pub register_timeout: u64,
    /// Print a JSON line per size as well.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchOp {
    Put,
    Get,
    Exists,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
    /// Bytes through the socket.
    Inline,
    /// Lease on the shared arena, copied out by the client.
    ZeroCopy,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Operation.
    #[arg(long, value_enum, default_value = "get")]
    pub op: BenchOp,
    /// Data path for get.
    #[arg(long, value_enum, default_value = "zero-copy")]
    pub mode: BenchMode,
    /// Bytes per page.
    #[arg(long, default_value = "1MiB")]
    pub page_size: String,
    /// Keys per request.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Client threads (one connection each).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Distinct pages in the working set (get/exists).
    #[arg(long, default_value_t = 256)]
    pub working_set: usize,
    /// Bytes the memcpy baseline's destination walks for `--op put` (the bench's puts walk
    /// fresh slots of the DRAM tier). For get the baseline walks the working set
    /// (`--working-set` pages) into one batch buffer, as the bench does.
    #[arg(long, default_value = "1GiB")]
    pub memcpy_pool: String,
    /// Print a JSON summary line as well.
    #[arg(long)]
    pub json: bool,
}

/// `kvnode bench backpressure` flags.
#[derive(Debug, Args)]
pub struct BackpressureArgs {
    /// Working directory (spill file, fio file, daemon log); on the device to measure.
    #[arg(long, default_value = "/var/tmp/kvnode-bench-backpressure")]
    pub dir: PathBuf,
    /// Block (page) size; also fio --bs.
    #[arg(long, default_value = "256KiB")]
    pub bs: String,
    /// Pages per put request.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Bytes put in all (and fio --size).
    #[arg(long, default_value = "4GiB")]
    pub size: String,
    /// DRAM tier of the daemon.
    #[arg(long, default_value = "256MiB")]
    pub dram: String,
    /// Offered put rate as a multiple of the fio write rate.
    #[arg(long, default_value_t = 2.0)]
    pub load: f64,
    /// Queue depth: fio --iodepth and the daemon's demotions in flight.
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
}
