//! `kvnode bench replay`: production traces through real daemons (issue 40), with the offline
//! optimum beside every run (docs/replay.md).
//!
//! ```text
//! trace.rs ─ requests ─> run.rs ─ per arm ─> fleet.rs (daemons) + events.rs (ZMQ SUB -> Index)
//!                          │                   drive.rs: router.rs places, engine.rs serves
//!                          │                   (GPU cache -> get [+ hinted pull] -> put)
//!                          ├─ offline.rs: ceiling, Belady's MIN, the policy offline
//!                          └─ report.rs (+ cost.rs model, svg.rs)
//! model.rs: the same deterministic replay with the daemons modelled (CI compares the two).
//! tier.rs: one DRAM tier's policy calls in the daemon's order (offline.rs and model.rs).
//! ```

pub mod blocks;
pub mod config;
pub mod cost;
pub mod drive;
pub mod engine;
pub mod events;
pub mod fleet;
pub mod model;
pub mod offline;
pub mod prefetch;
pub mod report;
pub mod router;
pub mod run;
pub mod svg;
pub mod tier;
pub mod trace;
pub mod waits;

pub use config::ReplayArgs;
pub use run::run;
