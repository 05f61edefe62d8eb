//! kvnode's own binding of UCX's UCP API (libucx 1.13) and a safe wrapper over it: what a
//! one-sided pull transport needs and nothing more.
//!
//! - [`Context`]: `ucp_init_version` (the UCP API's `ucp_init` is a static inline) with the
//!   RMA and WAKEUP features, reading `UCX_*` environment settings (`UCX_TLS`, ...).
//! - [`Region`]: `ucp_mem_map` of caller memory (the daemon maps its whole DRAM arena once)
//!   with explicit protection ([`Access`]: remote-read-only for what peers GET, local-only
//!   for where GETs land) and its packed remote key ([`PackedRkey`]); unmapped on drop, which revokes the key on
//!   transports that enforce it (verbs). [`MemoryKind`] is the seam for CUDA memory.
//! - [`Worker`]: a progress engine with its event fd (arm, then poll the fd).
//! - [`Progress`]: a worker driven by its own thread. The side whose memory is read must
//!   keep progressing: over UCX's TCP transport a GET is served in software by the target's
//!   worker, and the reader stalls if that worker sleeps.
//! - [`Resources`]: the transports a context selected, and whether each enforces memory keys
//!   in hardware (verbs RC/DC) or serves RMA in software (TCP, shared memory): the daemon
//!   exposes memory only over the former unless told the network is trusted.
//! - [`Remote`]: an endpoint to another process's worker with that process's unpacked remote
//!   key: [`Remote::get`], one bounded, cancellable `ucp_get_nbx`, or several in flight at once
//!   ([`Remote::post_get`], [`Remote::land_one`], [`Remote::abandon`]).
//!
//! Every handle is released by `Drop`, in dependency order (keys before endpoints before
//! workers before the context). [`PackedRkey`] and [`WorkerAddress`] print only their length:
//! they must never reach a log.

mod context;
mod error;
mod progress;
mod region;
mod remote;
mod resources;
mod sys;
mod worker;

pub use context::Context;
pub use error::UcxError;
pub use progress::Progress;
pub use region::{Access, MemoryKind, PackedRkey, Region};
pub use remote::Remote;
pub use resources::{HARDWARE_TLS, Resource, Resources};
pub use worker::{Worker, WorkerAddress};

#[cfg(test)]
mod tests;
