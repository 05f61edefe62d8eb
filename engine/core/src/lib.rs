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
//! - [`config`]: engine configuration with documented defaults.

pub mod api;
pub mod arena;
pub mod config;
pub mod peer;
pub mod policy;
pub mod tier;

pub use config::EngineConfig;
