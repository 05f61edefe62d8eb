//! `kvnode bench load`: clients that keep issuing requests to a running daemon across
//! whatever happens to it meanwhile (a takeover by a new pod in a rolling update, a reload),
//! and the service gap they saw.
//!
//! It puts `--blocks` blocks, starts `--clients` clients (the restart bench's load: gets of
//! those blocks with their bytes checked, a put every 16th request, a request the daemon's
//! hand-over cut retried on a new connection), waits until `--until` exists (e.g. the donor
//! pod's hand-over record) and `--after` more, then stops them and reads every block they put
//! back. It fails on a wrong byte, a kept block missing, or a put block lost; the gap is
//! reported, not judged (docs/benchmarks.md has the figures).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use kvnode_client::Client;
use kvnode_proto::size::parse_size;

use crate::restart_load::{Load, report};

/// `kvnode bench load` flags.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Unix socket path of the running daemon (default: $XDG_RUNTIME_DIR/kvnode/kvnode.sock
    /// or /run/kvnode/kvnode.sock).
    #[arg(long, env = "KVNODE_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Blocks put before the clients start (the ones they get).
    #[arg(long, default_value_t = 2000)]
    pub blocks: u64,
    /// Bytes per block.
    #[arg(long, default_value = "4KiB")]
    pub block_bytes: String,
    /// Clients, each on its own connection.
    #[arg(long, default_value_t = 2)]
    pub clients: u64,
    /// Keep the load on until this file exists (checked every 10 ms)...
    #[arg(long)]
    pub until: Option<PathBuf>,
    /// ...and this many seconds after it appeared (without `--until`: the whole run).
    #[arg(long, default_value_t = 2.0)]
    pub after_s: f64,
    /// Fail if `--until` has not appeared after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub timeout_s: f64,
}

/// Runs the load; an error if a client saw wrong bytes or a missing block, or a put was lost.
pub fn run(a: &LoadArgs) -> anyhow::Result<()> {
    let sock = a
        .socket
        .clone()
        .unwrap_or_else(kvnode_engine::config::default_socket);
    let bs = parse_size(&a.block_bytes).context("--block-bytes")?;
    let mut c = Client::connect(&sock)
        .with_context(|| format!("connecting to the daemon on {}", sock.display()))?;
    let pid_before = c.stats()?.pid;
    crate::restart::fill_blocks(&mut c, bs, a.blocks, false)?;
    drop(c);
    let load = Load::start(&sock, a.clients, bs, a.blocks);
    let t0 = Instant::now();
    let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    println!("load started at unix {:.6} s", unix.as_secs_f64());
    if let Some(f) = &a.until {
        while !f.exists() {
            if t0.elapsed().as_secs_f64() > a.timeout_s {
                // Stop the clients before failing, so none outlives the run.
                let _ = load.stop(t0, Instant::now());
                bail!("{} did not appear within {} s", f.display(), a.timeout_s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    std::thread::sleep(Duration::from_secs_f64(a.after_s));
    let r = load.stop(t0, Instant::now())?;
    let pid_after = Client::connect(&sock)?.stats()?.pid;
    println!("daemon pid {pid_before} when the load started, {pid_after} when it stopped");
    report(&r, &sock, bs, "the window", "the load started")
}
