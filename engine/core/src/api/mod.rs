//! The client protocol server: listener, connections, request handlers.
//!
//! ```text
//!  server ─> conn (handshake, frame loop) ─> Session::handle (dispatch.rs)
//!                                               ├─ data.rs     put / alloc / commit / exists / delete / clear
//!                                               ├─ fetch_plan.rs  exists with a recompute cost: the fetch plan
//!                                               ├─ get.rs      get in prefix order (inline streamed, lease or TooLarge)
//!                                               ├─ hinted.rs   hinted get / exists, Pull / Wait / Cancel
//!                                               ├─ region.rs   client memfd regions (region_copy.rs)
//!                                               └─ gpu.rs      GPU attach / offload / onload (gpu_conn.rs; hinted: gpu_pulled.rs)
//! ```
//!
//! Who may connect and which namespaces a connection's tenant may name: `tenancy.rs`.
//!
//! A [`session::Session`] owns everything a connection holds (leases, reservations,
//! regions, GPU mappings) as guards, so whatever ends the connection releases them.

mod act;
mod conn;
mod data;
mod dispatch;
mod errors;
mod fetch_plan;
mod gate;
mod get;
mod gpu;
mod gpu_conn;
mod gpu_copies;
mod gpu_pulled;
mod hinted;
pub mod io;
mod listed_op;
mod meta;
mod region;
mod region_copy;
mod router;
mod server;
mod session;
mod tenancy;

pub use router::{RouterGate, RouterRefused, Signed};
pub use server::{ServeError, bind, check_socket_dir, raise_fd_limit, serve};

#[cfg(test)]
mod gpu_tests;
