//! kvnode-engine: the daemon's machinery, in request order.
//!
//! ```text
//!  Unix socket ─> api (frames, handshake, per-connection leases)
//!                  └─> tier (index: key -> slot, leases, eviction policy)
//!                        └─> arena (one memfd, mapped shared, pinned in the background)
//!  TCP ─> peer (hinted pulls in, authenticated pulls out) ─> tier
//! ```
//!
//! - [`api`]: the client protocol server.
//! - [`arena`]: the shared-memory arena and its background pinning.
//! - [`tier`]: the DRAM tier's index, slot classes, leases and eviction.
//! - [`peer`]: router-hinted pulls between daemons (source and destination sides).
//! - [`policy`]: eviction policies (LRU, S3-FIFO).
//! - [`residency`]: per-(tier, block) residencies whose lifecycle publishes KV events.
//! - [`tiering`]: the NVMe spill tier under DRAM: demotion, promotion, restart survival.
//! - [`config`]: engine configuration with documented defaults.
//! - [`obs`]: histograms, counters, stall watchdog and Prometheus text.
//! - [`probes`]: the USDT probes (provider `kvnode`) every component fires.

pub mod api;
pub mod engine;
pub mod arena;
pub mod config;
pub mod obs;
pub mod peer;
pub mod policy;
pub mod probes;
pub mod residency;
mod size_serde;
pub mod store;
pub mod dram;
pub mod nvme;

pub use config::EngineConfig;
pub use engine::{Engine, StartError};
