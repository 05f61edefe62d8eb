//! KV events for the Dynamo KV router, published over ZMQ exactly as its listener parses them.
//!
//! ```text
//!  engine threads                 kvnode-events thread (own current-thread tokio runtime)
//!  EventSink::stored/removed/     +-----------------------------------------------------+
//!  cleared (Clone, never blocks)  |  Batcher: <= max_batch_events or flush_interval       |
//!    | validate() on the caller   |    -> [ts, events, dp_rank] msgpack (positional)     |
//!    | rejects -> counted         |    -> seq += 1 -> replay ring -> PUB [ "", seq, batch ]--> router SUB
//!    v                            |  replay ROUTER: [ "", start_seq ] -> [seq, batch]...   |
//!  bounded queue (full -> drop,   |                  closed by [-1, ""]                  <--> router DEALER
//!  counted, logged once) -------->+-----------------------------------------------------+
//! ```
//!
//! A router that (re)connects after the ring moved on gets a residency snapshot ([`snapshot`]):
//! asked for with `[ "", "kvnode:snapshot" ]`, or in place of a replay the ring no longer
//! covers. The engine registers the [`SnapshotSource`]; a marker on the event queue gives the
//! snapshot its exact seq.
//!
//! Access: events carry prompt token ids, so the sockets bind `ipc://` paths created with a
//! configured mode and group ([`ipc`]); `tcp://` needs [`Access::tcp_readable_by_anyone`].
//! Memory: the queue is bounded in events and bytes, the replay ring (kept only with a
//! replay endpoint) in batches and bytes, and each [`Account`] (a tenant) in its share of
//! both ([`account`]).
//!
//! The wire layout is interop.md §1 (and `docs/events.md`): positional arrays with every
//! slot up to `ownership` filled, media `"CPU_PINNED"` / `"DISK"`, the tenant salt in
//! `extra_keys[0]`. Every event is validated before it may join a batch, because the
//! router drops a whole batch for one bad event. The crate knows nothing of tiers or
//! residencies: the engine decides when a block is stored or removed and keeps parents
//! before children; this crate keeps that order and gets it onto the wire.

pub mod account;
pub mod batch;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod ipc;
pub mod publisher;
pub mod replay;
pub mod sink;
pub mod snapshot;
pub mod stats;
pub mod validate;
pub mod wire;

pub use account::{Account, AccountStats};
pub use batch::EventBatch;
pub use config::{Access, PublisherConfig};
pub use endpoint::Endpoint;
pub use error::{PublisherError, SinkError};
pub use publisher::Publisher;
pub use replay::{END_OF_REPLAY_SEQ, SNAPSHOT_REQUEST, SNAPSHOT_SEQ};
pub use sink::EventSink;
pub use snapshot::{Announced, SnapshotSource};
pub use stats::Stats;
pub use validate::{RejectReason, Rejection, ValidEvent, validate};
pub use wire::{
    AllBlocksCleared, BlockRemoved, BlockStored, CACHE_SALT_PREFIX, EventKind, KvEvent, Medium,
    router_hash,
};
