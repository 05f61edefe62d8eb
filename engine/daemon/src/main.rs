//! `kvnode`: the node-level KV-cache daemon and its operator commands.
//!
//! ```text
//! kvnode serve            run the daemon (embedded defaults; --config FILE and flags override)
//! kvnode put|get|exists   move pages by hex key or by token sequence
//! kvnode stats|clear      inspect or empty the cache
//! kvnode bench local      load generator against a running daemon
//! kvnode bench spill      demotion/promotion through a daemon vs fio on the same dir
//! kvnode bench events     KV events to a live ZMQ subscriber while serving puts
//! kvnode bench gpu        GPU offload/onload next to plain pinned cuMemcpy
//! kvnode bench pull       two daemons on loopback: peer pulls next to iperf3
//! kvnode report           latency percentile tables and SVG (live daemon or kvtrace file)
//! kvnode cluster members|status   cluster membership as the daemon sees it (--cluster)
//! ```

mod cli;
mod cluster;
mod cluster_cmd;
mod crash;
mod host_mem;
mod http;
mod keys;
mod metrics_http;
mod ops;
mod report;
mod restart_events;
mod router_http;
mod sd_notify;
mod seams;
mod serve;
mod serve_peer;
mod serve_stop;
mod stats_fmt;
mod svg;
mod takeover;
mod takeover_dir;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    if !matches!(cli.command, cli::Command::Serve(_) | cli::Command::Bench(_)) {
        // Operator commands behave like other Unix tools when their output is cut short
        // (`kvnode stats | head`): end quietly on SIGPIPE instead of panicking on the write.
        // The daemon keeps SIGPIPE ignored (a client closing its socket is an I/O error), and
        // so do the benchmarks: they are clients of daemons they stop and restart (`bench
        // restart` writes to a socket the old daemon may just have closed; that must be an
        // EPIPE it retries, not a signal that kills the run).
        // SAFETY: restoring the default disposition of one signal, before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        cli::Command::Serve(a) => serve::run(&a),
        cli::Command::Put(a) => ops::put(&a),
        cli::Command::Get(a) => ops::get(&a),
        cli::Command::Exists(a) => ops::exists(&a),
        cli::Command::Stats(a) => ops::stats(&a),
        cli::Command::Clear(a) => ops::clear(&a),
        cli::Command::Report(a) => report::run(&a),
        cli::Command::Cluster(a) => cluster_cmd::run(&a),
        cli::Command::Bench(b) => kvnode_bench::run(&b),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
