//! Command-line definitions.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// kvnode: node-level KV-cache daemon for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvnode", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon.
    Serve(Box<ServeArgs>),
    /// Store pages.
    Put(PutArgs),
    /// Fetch pages; prints how many leading pages hit.
    Get(GetArgs),
    /// Count leading pages present.
    Exists(KeyArgs),
    /// Print statistics.
    Stats(StatsArgs),
    /// Remove every page of one namespace (--model ...) or of all namespaces (--all).
    Clear(ClearArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(kvnode_bench::BenchCmd),
    /// Latency report (percentile tables, SVG) from the live daemon or a `kvtrace record` file.
    Report(ReportArgs),
    /// Cluster membership as the daemon sees it (daemons started with --cluster).
    Cluster(ClusterCmdArgs),
}

/// `kvnode cluster members|status`.
#[derive(Debug, Args)]
pub struct ClusterCmdArgs {
    /// `members`: every live member; `status`: health in one table.
    #[arg(value_enum)]
    pub what: ClusterWhat,
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ClusterWhat {
    Members,
    Status,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Read a `kvtrace record` (or `kvnode report --json`) file instead of asking the daemon.
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,
    /// Write an SVG with latency distributions per op and tier and throughput over time.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Save the report itself as JSON (readable again with --from).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// `serve` flags; each overrides the config file, which overrides the defaults.
#[derive(Debug, Args)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent on/off flags of the CLI"
)]
pub struct ServeArgs {
    /// TOML config file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Unix socket path.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// DRAM tier size (e.g. 512MiB, 16GiB).
    #[arg(long)]
    pub dram: Option<String>,
    /// Slab size (largest slot; unit moved between slot classes).
    #[arg(long)]
    pub slab_size: Option<String>,
    /// Eviction policy.
    #[arg(long, value_enum)]
    pub eviction: Option<Eviction>,
    /// Do not mlock the arena.
    #[arg(long)]
    pub no_pin: bool,
    /// Do not fault the arena in ahead of use.
    #[arg(long)]
    pub no_populate: bool,
    /// Back the arena with hugetlbfs pages.
    #[arg(long)]
    pub hugetlb: bool,
    /// How client regions that cannot be sealed are copied: through a SIGBUS-guarded mapping
    /// (default) or with pread/pwrite.
    #[arg(long, value_enum)]
    pub region_copy: Option<RegionCopyArg>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics: Option<String>,
    /// Serve the router entry at http://HOST:PORT/v1/act: signed hints envelopes from a
    /// router (needs --cluster-key and --events; docs/router-entry.md).
    #[arg(long, value_name = "HOST:PORT")]
    pub router_listen: Option<String>,
    /// Report leases held longer than this many seconds (log, metric, probe).
    #[arg(long, value_name = "SECONDS")]
    pub lease_age_limit: Option<f64>,
    /// Report client ops in flight longer than this many seconds as stalls.
    #[arg(long, value_name = "SECONDS")]
    pub op_deadline: Option<f64>,
    /// Print the effective config and exit.
    #[arg(long)]
    pub print_config: bool,
    /// NVMe spill directory (repeatable, one per device; pair each with --spill-size).
    #[arg(long)]
    pub spill_dir: Vec<PathBuf>,
    /// Bytes the spill file in the matching --spill-dir may use (e.g. 64GiB).
    #[arg(long)]
    pub spill_size: Vec<String>,
    /// Which evicted DRAM blocks are written to NVMe.
    #[arg(long, value_enum)]
    pub spill_admission: Option<SpillAdmission>,
    /// Spill IO engine (psync for file systems without O_DIRECT, e.g. tmpfs).
    #[arg(long, value_enum)]
    pub spill_engine: Option<SpillEngineArg>,
    /// Write-behind: every DRAM block is also copied to the spill tier, aiming at this lag
    /// (e.g. 500ms, 2s; a target, not a bound: puts are not slowed). Off by default.
    #[arg(long, value_name = "DURATION")]
    pub spill_lag: Option<String>,
    /// Take over the DRAM tier (arena, index, listening socket) of the daemon running on this
    /// socket: an upgrade that keeps every block and copies none. Starts cold if no daemon
    /// runs there; fails, with the reason, if it refuses (e.g. another --dram).
    #[arg(long)]
    pub takeover: bool,
    /// Takeover socket (config `takeover_socket`): in a directory only the daemon's uid may
    /// enter, never the client socket's. Default: <socket dir>-admin/<socket name>.takeover.
    #[arg(long, value_name = "PATH")]
    pub takeover_socket: Option<PathBuf>,
    /// Serve even though the socket's directory may be written by other users (group- or
    /// world-writable, e.g. /tmp): someone else could then replace the socket. Off by
    /// default (the daemon refuses to start there). The takeover socket's directory is
    /// checked on its own and must be the daemon's alone either way.
    #[arg(long)]
    pub allow_shared_socket_dir: bool,
    /// Publish KV events on a ZMQ PUB socket bound here: ipc:///PATH (a Unix socket created
    /// with --events-socket-mode/--events-socket-group), or tcp://HOST:PORT with
    /// --events-tcp-readable-by-anyone. Events carry prompt token ids: see docs/events.md.
    #[arg(long, value_name = "ipc:///PATH")]
    pub events: Option<String>,
    /// Serve event replay on a ZMQ ROUTER socket bound here (same forms as --events).
    /// Without it no replay ring is kept.
    #[arg(long, requires = "events", value_name = "ipc:///PATH")]
    pub events_replay: Option<String>,
    /// Mode of the ipc:// event socket files, octal (0600, or 0660 with a group).
    #[arg(long, requires = "events", value_parser = parse_octal_mode, value_name = "MODE")]
    pub events_socket_mode: Option<u32>,
    /// Group (gid) of the ipc:// event socket files: the router's.
    #[arg(long, requires = "events", value_name = "GID")]
    pub events_socket_group: Option<u32>,
    /// Allow tcp:// event endpoints. Anyone who reaches the port, every local user
    /// included, then reads every published block's prompt token ids and tenant salt.
    #[arg(long, requires = "events")]
    pub events_tcp_readable_by_anyone: bool,
    /// Most payload bytes kept for event replay (default 64MiB).
    #[arg(long, requires = "events_replay", value_name = "SIZE")]
    pub events_replay_bytes: Option<String>,
    /// Most batches kept for event replay (default 10000); older requests get a snapshot.
    #[arg(long, requires = "events_replay", value_name = "N")]
    pub events_replay_len: Option<usize>,
    /// Data-parallel rank written into every event batch.
    #[arg(long, requires = "events")]
    pub dp_rank: Option<u32>,
    #[command(flatten)]
    pub peer: crate::serve_peer::PeerArgs,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SpillAdmission {
    Always,
    SecondRead,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SpillEngineArg {
    Uring,
    Psync,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RegionCopyArg {
    Guarded,
    Pread,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Eviction {
    Lru,
    S3fifo,
    Chain,
}

/// Where the daemon is.
#[derive(Debug, Args)]
pub struct SocketArg {
    /// Unix socket path (default: $XDG_RUNTIME_DIR/kvnode/kvnode.sock or /run/kvnode/kvnode.sock).
    #[arg(long, env = "KVNODE_SOCKET")]
    pub socket: Option<PathBuf>,
}

/// The namespace pages live in.
#[derive(Debug, Args, Clone)]
pub struct NsArgs {
    /// Model name [put/get/exists default: "default"; clear needs it or --all].
    #[arg(long)]
    pub model: Option<String>,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// KV dtype.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Host layout.
    #[arg(long, default_value = "page_first")]
    pub layout: String,
    /// Bytes per page (slot size of the namespace's single segment).
    #[arg(long, default_value = "64KiB")]
    pub page_bytes: String,
    /// Tensor-parallel rank and size.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    #[arg(long, default_value_t = 1)]
    pub tp_size: u32,
    /// Tenant salt.
    #[arg(long, default_value = "")]
    pub salt: String,
}

/// How pages are named: hex digests, or a token sequence hashed SGLang's way.
#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    #[command(flatten)]
    pub ns: NsArgs,
    /// Page digests as 64-char hex, comma separated.
    #[arg(long, value_delimiter = ',', conflicts_with = "tokens")]
    pub keys: Vec<String>,
    /// Token ids, comma separated: one page per full `--page-size` tokens.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<u32>,
    /// SGLang extra_key (seeds the digest chain).
    #[arg(long)]
    pub extra_key: Option<String>,
    /// SGLang cache_salt (seeds the digest chain).
    #[arg(long)]
    pub cache_salt: Option<String>,
}

#[derive(Debug, Args)]
pub struct PutArgs {
    #[command(flatten)]
    pub keys: KeyArgs,
    /// Take the bytes from this file, cut into one chunk of --page-bytes per page.
    #[arg(long, conflicts_with = "seed")]
    pub file: Option<PathBuf>,
    /// Generate deterministic bytes from this seed (page i gets stream (seed, digest)).
    #[arg(long)]
    pub seed: Option<u64>,
    /// List every refused page (default: counts per status and the first few keys).
    #[arg(long)]
    pub verbose: bool,
}

#[derive(Debug, Args)]
pub struct GetArgs {
    #[command(flatten)]
    pub keys: KeyArgs,
    /// Write the leading hits, concatenated, to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Read through a lease on the shared arena instead of inline bytes.
    #[arg(long)]
    pub zero_copy: bool,
    /// Router hint (Dynamo kv.fetch envelope or compact JSON), or @FILE to read it from.
    #[arg(long)]
    pub hint: Option<String>,
    /// Milliseconds to wait for a hinted pull (default: the daemon's declared timeouts).
    #[arg(long)]
    pub deadline_ms: Option<u64>,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ClearArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    #[command(flatten)]
    pub ns: NsArgs,
    /// Clear every namespace (instead of the one named by --model and the other flags).
    #[arg(long, conflicts_with = "model")]
    pub all: bool,
}

/// Parses an octal file mode (`0600`, `0o660`, `660`).
pub fn parse_octal_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    u32::from_str_radix(digits, 8).map_err(|_| format!("{s:?} is not an octal mode such as 0600"))
}
