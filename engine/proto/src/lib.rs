//! kvnode-proto: the types every kvnode component agrees on, with no I/O.
//!
//! ```text
//!  tokens ──hash──> Digest ─┐
//!  NamespaceSpec ──digest──> NamespaceId ─┼─> BlockKey (namespace, digest, segment)
//!                                          │
//!  client ──frame(Request)──> daemon ──frame(Reply)──> client
//! ```
//!
//! - [`key`]: block keys, page digests and namespace ids.
//! - [`namespace`]: the namespace spec and its 128-bit identity digest.
//! - [`hash`]: SGLang's chained SHA-256 page digests and the router's u64 hash.
//! - [`frame`]: the length-prefixed frame layout shared by client and daemon.
//! - [`client`]: client requests and daemon replies.
//! - [`gpu`]: GPU path wire types: IPC handles, page layouts and their arithmetic.
//! - [`peer`]: peer-to-peer pull protocol messages.
//! - [`plan`]: fetch plans (fetch or recompute) and measured path costs.
//! - [`pull`]: client-visible pull operations and declared timeouts.
//! - [`hint`]: router `kv.fetch` hints, parsed as untrusted input.
//! - [`actions`]: every action of a router's hints envelope, parsed as untrusted input.
//! - [`stats`]: the statistics report returned by `stats`.
//! - [`cluster`]: cluster membership as reported by `cluster`, `stats` and `/metrics`.
//! - [`obs`]: probe codes and the latency report (`histograms` op, `kvtrace record`).
//! - [`size`]: human byte sizes (`512MiB`, `16GiB`).

pub mod actions;
pub mod client;
pub mod cluster;
pub mod frame;
pub mod gpu;
pub mod hash;
pub mod hint;
pub mod key;
pub mod namespace;
pub mod obs;
pub mod peer;
pub mod plan;
pub mod pull;
pub mod router;
pub mod size;
pub mod stats;

pub use client::{ErrorCode, GetMode, Op, Reply, Request};
pub use frame::{FrameError, FramePrefix};
pub use key::{BlockKey, Digest, Key, NamespaceId};
pub use namespace::NamespaceSpec;

/// Version of the client protocol spoken by this build; the handshake refuses any other.
pub const PROTOCOL_VERSION: u32 = 1;
