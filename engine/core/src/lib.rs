//! kvnode-engine: the daemon's machinery, in request order.
//!
//! ```text
//!  Unix socket ─> api (frames, handshake, per-connection guards) ─┐
//!  TCP ─> peer (hinted pulls in, authenticated pulls out) ─────────┼─> store (lookup order DRAM → NVMe,
//!  GPU ops (api/gpu.rs) ───────────────────────────────────────────┘    RAII leases and reservations)
//!                                                                      ├─> dram  (index, slot classes, eviction)
//!                                                                      ├─> nvme  (spill tier, demoter)
//!                                                                      └─> arena (one memfd, pinned in the background)
//! ```
//!
//! - [`engine`]: wires the store, the peer service, the GPU path and the metrics together.
//! - [`api`]: the client protocol server (imports `engine`; nothing imports `api`).
//! - [`store`]: the node store, the only owner of the lookup order and of slot guards.
//! - [`dram`]: the DRAM tier's index, slot classes, leases and eviction.
//! - [`nvme`]: the NVMe spill tier under DRAM: promotion reads, demotion, restart survival.
//! - [`arena`]: the shared-memory arena and its background pinning.
//! - [`peer`]: router-hinted pulls between daemons (source and destination sides).
//! - [`plan`]: fetch plans: the leading keys worth fetching rather than recomputing.
//! - [`policy`]: eviction policies (LRU, S3-FIFO).
//! - [`residency`]: per-(tier, block) residencies whose lifecycle publishes KV events.
//! - [`tenant`]: tenant map (uid/gid → tenant), daemon-derived namespace salts, quotas' scope.
//! - [`config`]: engine configuration with documented defaults.
//! - [`obs`]: histograms, counters, stall watchdog and Prometheus text.
//! - [`probes`]: the USDT probes (provider `kvnode`) every component fires.
//!
//! No module imports one that imports it back (`scripts/check-import-cycles.py`).

pub mod api;
pub mod arena;
pub mod config;
pub mod dram;
pub mod engine;
pub mod nvme;
pub mod obs;
pub mod peer;
pub mod plan;
pub mod policy;
pub mod probes;
pub mod residency;
mod size_serde;
pub mod store;
pub mod tenant;

pub use config::EngineConfig;

/// Whether this build carries the test seams (feature `test-seams`: fault-injecting spill
/// engine and peer transport, the fake GPU, test hooks). A release daemon built with
/// `cargo build --release -p kvnode` has none; the workspace test build has them.
pub const TEST_SEAMS: bool = cfg!(feature = "test-seams");
pub use engine::{Engine, StartError};
