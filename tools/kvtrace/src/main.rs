//! kvtrace: eBPF tracing of running kvnode daemons (USDT probes + io_uring tracepoints).
//!
//! ```text
//! kvnode serve ──USDT kvnode:op_start/op_done/stall/lease_overdue/...──┐
//! kernel io_uring_submit_req / io_uring_complete (raw tracepoints) ─────┤
//!                                     ebpf/kvtrace.bpf.c: log2 histograms in maps, events in a ring
//!                                            └──> kvtrace latency | stalls | record --out FILE
//! ```

mod abi;
mod cmd;
mod target;
mod tracer;

mod skel {
    #![allow(
        clippy::pedantic,
        missing_debug_implementations,
        unsafe_op_in_unsafe_fn
    )]
    include!(concat!(env!("OUT_DIR"), "/kvtrace.skel.rs"));
}

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Trace latency and stalls of running kvnode daemons with eBPF.
#[derive(Debug, Parser)]
#[command(name = "kvtrace", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args, Clone)]
struct Target {
    /// Daemon pid (repeatable); default: every `kvnode serve` process.
    #[arg(long)]
    pid: Vec<u32>,
    /// Seconds between refreshes (latency) or timeline samples (record).
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Stop after this many seconds (default: until Ctrl-C / SIGTERM).
    #[arg(long)]
    duration: Option<f64>,
}

#[derive(Debug, Args, Clone, Copy)]
struct Clock {
    /// Time ops in the kernel from `op_start` to `op_done` (two probe hits per op and a hash
    /// map update, about twice the overhead) instead of taking the latency the daemon measured
    /// and passes in `op_done` (one hit per op).
    #[arg(long)]
    kernel_latency: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Live per-op, per-tier and per-peer latency histograms, refreshed every interval.
    Latency {
        #[command(flatten)]
        target: Target,
        /// Show cumulative tables instead of the last interval's.
        #[arg(long)]
        cumulative: bool,
        #[command(flatten)]
        clock: Clock,
    },
    /// Stalls as they happen: stalled offload/pinning, ops past deadline, overdue leases,
    /// slow ops and slow io_uring completions.
    Stalls {
        #[command(flatten)]
        target: Target,
        /// Report completed ops slower than this many milliseconds (0 = off).
        #[arg(long, default_value_t = 0.0)]
        op_slow_ms: f64,
        /// Report io_uring completions slower than this many microseconds (0 = off).
        #[arg(long, default_value_t = 5000.0)]
        uring_slow_us: f64,
    },
    /// Record histograms and throughput to a JSON file for `kvnode report --from FILE`.
    Record {
        #[command(flatten)]
        target: Target,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        clock: Clock,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Latency {
            target,
            cumulative,
            clock,
        } => cmd::latency(&target, cumulative, clock.kernel_latency),
        Command::Stalls {
            target,
            op_slow_ms,
            uring_slow_us,
        } => cmd::stalls(&target, op_slow_ms, uring_slow_us),
        Command::Record { target, out, clock } => cmd::record(&target, &out, clock.kernel_latency),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtrace: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
