//! `kvnode`: the node-level KV-cache daemon and its operator commands.
//!
//! ```text
//! kvnode serve            run the daemon (embedded defaults; --config FILE and flags override)
//! kvnode put|get|exists   move pages by hex key or by token sequence
//! kvnode stats|clear      inspect or empty the cache
//! kvnode bench local      load generator against a running daemon
//! kvnode bench pull       two daemons on loopback: peer pulls next to iperf3
//! ```

mod bench;
mod bench_pull;
mod cli;
mod keys;
mod ops;
mod serve;
mod serve_peer;
mod stats_fmt;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Serve(a) => serve::run(&a),
        cli::Command::Put(a) => ops::put(&a),
        cli::Command::Get(a) => ops::get(&a),
        cli::Command::Exists(a) => ops::exists(&a),
        cli::Command::Stats(a) => ops::stats(&a),
        cli::Command::Clear(a) => ops::clear(&a),
        cli::Command::Bench(cli::BenchCmd::Local(a)) => bench::local(&a),
        cli::Command::Bench(cli::BenchCmd::Pull(a)) => bench_pull::run(&a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
