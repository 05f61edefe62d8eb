//! kvnode-bench: the benchmarks behind `kvnode bench ...`, out of the daemon crate.
//!
//! Every benchmark reports a ratio against a physical limit measured in the same run
//! (docs/benchmarks.md has the figures and the commands):
//!
//! - [`local`]: load against a running daemon (get zero-copy / inline, put, exists) vs memcpy.
//! - [`spill`]: demotion and promotion through a daemon it starts, vs fio on the same dir.
//! - [`events`]: KV events reaching a live ZMQ subscriber while the daemon serves puts.
//! - [`gpu`]: GPU offload/onload through the daemon vs plain pinned `cuMemcpy`.
//! - [`pull`]: two daemons on loopback: peer pulls vs iperf3 and memcpy; a pulled page's
//!   latency vs [`relay`], the same socket hops with nothing else; a pulled prefix delivered
//!   into a client region, streamed against staged ([`deliver`]).
//! - [`backpressure`]: puts offered at twice the disk's rate through a small DRAM tier, vs fio.
//! - [`evict`]: offline hit rates of the eviction policies on a trace vs Belady's MIN.
//! - [`replay`]: a production trace through daemons it starts, against Belady's MIN and the
//!   infinite-cache ceiling (docs/replay.md).
//! - [`restart`]: first hit after a takeover, a SIGKILL or a SIGTERM restart, vs the time to
//!   spawn the binary; with [`restart_load`], the service gap clients see across a takeover.
//! - [`load`]: that load against a running daemon, across whatever happens to it meanwhile (a
//!   rolling update's takeover by a new pod).

pub mod args;
pub mod backpressure;
pub mod deliver;
pub mod events;
pub mod evict;
pub mod gpu;
pub mod load;
pub mod local;
pub mod memcpy;
pub mod pull;
pub mod relay;
pub mod replay;
pub mod restart;
pub mod restart_load;
pub mod restart_probe;
pub mod socket;
pub mod spill;

pub use args::BenchCmd;

/// Runs one benchmark.
pub fn run(cmd: &BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Local(a) => local::local(a),
        BenchCmd::Spill(a) => spill::spill(a),
        BenchCmd::Gpu(a) => gpu::run(a),
        BenchCmd::Events(a) => events::run(a),
        BenchCmd::Pull(a) => pull::run(a),
        BenchCmd::Restart(a) => restart::run(a),
        BenchCmd::Backpressure(a) => backpressure::run(a),
        BenchCmd::Evict(a) => evict::run(a),
        BenchCmd::Replay(a) => replay::run(a),
        BenchCmd::Load(a) => load::run(a),
    }
}
