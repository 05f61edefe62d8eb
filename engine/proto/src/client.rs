//! Client requests and daemon replies (docs/client-protocol.md is the normative spec).
//!
//! Every request carries an `id` that its reply repeats. Ops that move bytes describe them
//! in the header and carry them raw in the frame payload, in key order.

use serde::{Deserialize, Serialize};

use crate::key::Key;
use crate::namespace::NamespaceSpec;
use crate::obs::{LatencyReport, OpKind};
use crate::pull::{OpReport, TimeoutReport};
use crate::stats::StatsReport;

/// One request frame's header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the client, echoed in the reply.
    pub id: u64,
    /// What to do.
    pub op: Op,
}

/// How `get` hands bytes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GetMode {
    /// Bytes follow the reply header as the frame payload.
    Inline,
    /// The reply names arena extents the client reads from its mapping; they stay valid
    /// until `Release` or until the connection closes.
    Lease,
}

/// A client operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// First frame of every connection. The reply carries the arena memfd (SCM_RIGHTS).
    Hello {
        /// Must equal [`crate::PROTOCOL_VERSION`].
        version: u32,
        /// Free-form client name for logs.
        client: String,
    },
    /// Declares a namespace; returns its handle and the slot class of each segment.
    Register {
        /// The spec.
        spec: NamespaceSpec,
    },
    /// Stores blocks whose bytes are the frame payload, concatenated in key order.
    Put {
        /// Namespace handle from `Register`.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Byte length of each block.
        lens: Vec<u64>,
        /// Optional router metadata per key (empty, or one entry per key); absent from old
        /// clients. Blocks with tokens are announced as KV events.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        meta: Vec<Option<BlockMeta>>,
    },
    /// Reserves arena slots the client fills through its mapping, then commits.
    Alloc {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Byte length each block will have.
        lens: Vec<u64>,
        /// Optional router metadata per key, as for `Put`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        meta: Vec<Option<BlockMeta>>,
    },
    /// Publishes filled slots; each becomes an immutable block.
    Commit {
        /// Handles from `Alloc`.
        handles: Vec<u64>,
    },
    /// Gives back reserved slots without publishing them.
    Abort {
        /// Handles from `Alloc`.
        handles: Vec<u64>,
    },
    /// Fetches blocks.
    Get {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Inline bytes or a lease on arena extents.
        mode: GetMode,
        /// Router hint (`kv.fetch` envelope or compact JSON): pull the covered missing
        /// prefix from the named peer before answering. Untrusted; refused with a reason.
        #[serde(default)]
        hint: Option<String>,
        /// Milliseconds to wait for the pull (default: the declared timeout model).
        #[serde(default)]
        deadline_ms: Option<u64>,
    },
    /// Ends a lease taken by `Get { mode: Lease }`.
    Release {
        /// Lease id.
        lease: u64,
    },
    /// Counts the leading keys present (SGLang `batch_exists` semantics).
    Exists {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Router hint: start pulling the covered missing prefix in the background.
        #[serde(default)]
        hint: Option<String>,
        /// The engine's recompute cost: the reply then carries a fetch plan, and a hint's
        /// pull starts only when the plan takes the peer (docs/fetch-plans.md).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        recompute: Option<crate::plan::RecomputeCost>,
    },
    /// Removes blocks.
    Delete {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Refreshes the leading run of keys held in DRAM in the eviction policy, as a get of
    /// them would, without reading them: an engine's GPU prefix-cache hits, which otherwise
    /// never reach the daemon (docs/client-protocol.md).
    Touch {
        /// Namespace handle.
        ns: u32,
        /// Keys, in prefix order.
        keys: Vec<Key>,
    },
    /// Removes every block of a namespace, or of all namespaces with `ns: None`.
    Clear {
        /// Namespace handle, or `None` for everything.
        ns: Option<u32>,
    },
    /// Per-tier and per-namespace statistics.
    Stats,
    /// Starts a pull operation and answers at once with its report. With `into` (handles from
    /// `Alloc`, one per key), pulled bytes are also copied into those slots, which the op
    /// owns until it ends: `Wait` or `Cancel` hands them back.
    Pull {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Router hint.
        hint: String,
        /// Alloc handles to fill (empty: only the daemon's DRAM tier).
        #[serde(default)]
        into: Vec<u64>,
        /// Deadline in milliseconds (default: the declared timeout model).
        #[serde(default)]
        deadline_ms: Option<u64>,
    },
    /// Waits up to `timeout_ms` for an operation to end; answers with its report.
    Wait {
        /// Operation id.
        op: u64,
        /// Milliseconds.
        timeout_ms: u64,
    },
    /// Cancels an operation. The reply is a fence: no byte is written into the op's buffers
    /// after it. Blocks still in flight land in the DRAM tier (never in the op's buffers).
    Cancel {
        /// Operation id.
        op: u64,
    },
    /// The declared prefetch timeout model and the measurements behind it.
    Timeouts,
    /// Live latency histograms per op and tier, and throughput over time.
    Histograms,
    /// Cluster membership: health and the live members (`kvnode cluster`).
    Cluster,
    /// Maps client memory: this frame carries a memfd (SCM_RIGHTS) of at least `len` bytes,
    /// which the daemon maps shared until `DetachRegion` or until the connection closes.
    AttachRegion {
        /// Bytes of the descriptor the client lets the daemon use, from offset 0.
        len: u64,
    },
    /// Unmaps a region attached on this connection.
    DetachRegion {
        /// Region id from `AttachRegion`.
        region: u32,
    },
    /// Copies blocks into the client's region; the reply is sent after every write is done.
    GetToRegion {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Region id from `AttachRegion`.
        region: u32,
        /// Destination byte offset of each key in the region.
        offsets: Vec<u64>,
        /// Room at each offset; a hit longer than its room is an error (nothing written).
        lens: Vec<u64>,
        /// Router hint, as for `Get`: the covered missing prefix is pulled first.
        #[serde(default)]
        hint: Option<String>,
        /// Milliseconds to wait for the pull (default: the declared timeout model).
        #[serde(default)]
        deadline_ms: Option<u64>,
    },
    /// Stores blocks whose bytes the daemon reads from the client's region.
    PutFromRegion {
        /// Namespace handle.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Region id from `AttachRegion`.
        region: u32,
        /// Source byte offset of each key in the region.
        offsets: Vec<u64>,
        /// Byte length of each block.
        lens: Vec<u64>,
    },
    /// Maps a GPU buffer exported as a CUDA IPC handle (docs/gpu.md); replies `GpuAttached`.
    AttachGpu(crate::gpu::AttachGpu),
    /// Copies GPU pages into the DRAM tier; replies `Offloaded` once committed.
    Offload(crate::gpu::PageMove),
    /// Copies blocks into GPU pages; replies `Onloaded` once every copy has completed.
    Onload(crate::gpu::PageMove),
    /// Starts an onload; replies `OnloadStarted` at once. Finish with `OnloadWait` or `OnloadCancel`.
    OnloadAsync(crate::gpu::PageMove),
    /// Waits for a started onload; replies `Onloaded`.
    OnloadWait {
        /// Ticket from `OnloadStarted`.
        ticket: u64,
    },
    /// Stops issuing a started onload's copies and waits for those issued; replies `Onloaded`.
    /// Once it returns, the daemon never writes that onload's pages again.
    OnloadCancel {
        /// Ticket from `OnloadStarted`.
        ticket: u64,
    },
    /// Executes every action of a router's hints envelope (`kv.prefetch`, `kv.retain`,
    /// `kv.release`, `kv.demote`, `kv.evict`, `kv.fetch`; docs/client-protocol.md) on the keys
    /// of one request: an action applies to the keys whose router hash it names. Replies
    /// `Acted`, one result per action; an action the daemon does not execute is refused there
    /// by name, the others still run.
    Act {
        /// Namespace handle.
        ns: u32,
        /// The request's keys, in prefix order.
        keys: Vec<Key>,
        /// The envelope (JSON).
        hints: String,
    },
    /// Waits until layer `layer` of a started layer-wise onload (`PageMove::layers` > 0) has
    /// landed in every page; replies `LayerLoaded`. The onload stays pending: finish it with
    /// `OnloadWait` or `OnloadCancel`.
    OnloadLayerWait {
        /// Ticket from `OnloadStarted`.
        ticket: u64,
        /// Layer, `0..layers`.
        layer: u32,
    },
}

/// What the KV router needs to know about a page: its exact tokens and its parent page.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMeta {
    /// The page's exact token ids (`page_size` of them).
    pub tokens: Vec<u32>,
    /// Digest of the page before this one in its chain; `None` for a chain root.
    #[serde(default)]
    pub parent: Option<crate::key::Digest>,
}

/// Outcome of one key of a `Put`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PutStatus {
    /// Stored now.
    Stored,
    /// Already present (blocks are immutable; the bytes sent were discarded).
    Exists,
    /// No slot could be freed (everything evictable is leased).
    NoSpace,
    /// Longer than the segment's slot size.
    TooLarge,
    /// Segment number not declared by the namespace.
    BadSegment,
}

/// Outcome of one key of an `Alloc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocSlot {
    /// Reserved: write `len` bytes at arena `offset`, then commit `handle`.
    Granted {
        /// Commit/abort handle.
        handle: u64,
        /// Byte offset in the arena mapping.
        offset: u64,
        /// Bytes to write.
        len: u64,
    },
    /// Not reserved; see the status.
    Refused {
        /// Why.
        status: PutStatus,
    },
}

/// Outcome of one handle of a `Commit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommitStatus {
    /// The block is now visible.
    Committed,
    /// Another writer committed the same key first; this slot was freed.
    Duplicate,
    /// The handle is unknown to this connection (never allocated here, or already used).
    UnknownHandle,
}

/// An arena extent under lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Byte offset in the arena mapping.
    pub offset: u64,
    /// Block length.
    pub len: u64,
}

/// Slot class chosen for one declared segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentClass {
    /// Segment number.
    pub segment: u16,
    /// Declared slot size in bytes.
    pub slot_size: u64,
    /// Pool (slot class) index serving it.
    pub class: u32,
    /// Bytes of the class's slots (declared size rounded up to 4 KiB).
    pub class_slot_bytes: u64,
}

/// Machine-readable error category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Frame or header could not be decoded.
    Malformed,
    /// The first frame was not a valid `Hello`, or its version differs.
    Handshake,
    /// Namespace handle unknown.
    UnknownNamespace,
    /// Lease or handle not owned by this connection.
    NotOwned,
    /// Request is well formed but its fields are inconsistent.
    Invalid,
    /// The spec or size is not supported by this daemon's configuration.
    Unsupported,
    /// The daemon is shutting down.
    ShuttingDown,
    /// Internal failure (a bug, logged by the daemon).
    Internal,
    /// The client's uid is at one of its per-uid caps (connections, attached regions,
    /// leased blocks; `[tenants.limits]`): the message names the cap. Release what it
    /// holds, or have the operator raise the cap; nothing changed.
    LimitReached,
}

/// One reply frame's header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id (0 for errors raised before a request id was known).
    pub id: u64,
    /// The answer.
    pub reply: Reply,
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// Handshake accepted; the arena memfd rides along as SCM_RIGHTS.
    HelloOk {
        /// Protocol version.
        version: u32,
        /// Daemon build.
        server: String,
        /// Daemon pid.
        pid: u32,
        /// Arena size in bytes (map this much of the fd).
        arena_bytes: u64,
    },
    /// Namespace registered (or found: registration is idempotent).
    Registered {
        /// Handle to use in later requests (valid for the daemon's lifetime).
        ns: u32,
        /// The 128-bit namespace id, hex.
        id: String,
        /// Slot class per segment.
        segments: Vec<SegmentClass>,
    },
    /// Per-key outcome of a `Put`.
    Put {
        /// In key order.
        results: Vec<PutStatus>,
    },
    /// Per-key outcome of an `Alloc`.
    Alloc {
        /// In key order.
        slots: Vec<AllocSlot>,
    },
    /// Per-handle outcome of a `Commit`.
    Commit {
        /// In handle order.
        results: Vec<CommitStatus>,
    },
    /// Slots given back by `Abort`.
    Aborted {
        /// How many handles were known and released.
        count: u32,
    },
    /// Inline get: lengths per key (`None` = miss); bytes of hits follow as the payload.
    GetInline {
        /// In key order.
        lens: Vec<Option<u64>>,
        /// The pull operation a hint started, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pull: Option<Box<OpReport>>,
    },
    /// Lease get: extents per key (`None` = miss).
    GetLease {
        /// Lease id for `Release` (0 when nothing was found and no lease was taken).
        lease: u64,
        /// In key order.
        extents: Vec<Option<Extent>>,
        /// The pull operation a hint started, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pull: Option<Box<OpReport>>,
    },
    /// Lease ended.
    Released,
    /// Number of leading keys present.
    Exists {
        /// Count.
        count: u32,
        /// The background pull a hint started, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pull: Option<Box<OpReport>>,
        /// The fetch plan, when the request carried a recompute cost.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        plan: Option<Box<crate::plan::FetchPlan>>,
    },
    /// The leading keys `Touch` found in DRAM and refreshed.
    Touched {
        /// Count.
        count: u32,
    },
    /// Blocks removed by `Delete`.
    Deleted {
        /// Count.
        count: u32,
    },
    /// Blocks removed by `Clear`.
    Cleared {
        /// Count.
        count: u64,
    },
    /// Statistics.
    Stats(Box<StatsReport>),
    /// A pull operation's report (`Pull`, `Wait`, `Cancel`).
    Op(Box<OpReport>),
    /// Declared timeouts.
    Timeouts(Box<TimeoutReport>),
    /// Latency histograms.
    Histograms(Box<LatencyReport>),
    /// Cluster membership (`Cluster`).
    Cluster(Box<crate::cluster::ClusterReport>),
    /// Client memory mapped.
    RegionAttached {
        /// Id for `GetToRegion` / `PutFromRegion` (valid on this connection only).
        region: u32,
        /// Bytes mapped.
        len: u64,
    },
    /// Region unmapped.
    RegionDetached,
    /// Per-key outcome of a `GetToRegion`: bytes written at the key's offset, `None` = miss.
    GotToRegion {
        /// In key order.
        lens: Vec<Option<u64>>,
        /// The pull operation a hint started, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pull: Option<Box<crate::pull::OpReport>>,
    },
    /// A GPU buffer is mapped.
    GpuAttached {
        /// Buffer id for `PageMove::buffer`.
        buffer: u32,
        /// Bytes of each page's block.
        page_bytes: u64,
    },
    /// Per-key outcome of an `Offload` (all copies done and committed).
    Offloaded {
        /// In key order.
        results: Vec<PutStatus>,
    },
    /// Per-key outcome of an onload; every copy it issued has completed.
    Onloaded {
        /// In key order.
        results: Vec<crate::gpu::OnloadStatus>,
        /// The pull operation a hint started, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pull: Option<Box<crate::pull::OpReport>>,
    },
    /// An onload was started.
    OnloadStarted {
        /// For `OnloadWait` / `OnloadCancel`.
        ticket: u64,
    },
    /// A get that holds its pages (lease mode, GPU onload) cannot have all of them leased
    /// now; nothing was leased. The leading `leasable` keys can be: ask for those, use
    /// and release them, then ask for the rest (never a result with a hole at the front).
    TooLarge {
        /// Leading keys that can be leased by one request now (0: none; retry later).
        leasable: u32,
        /// Why (the limit that was hit).
        message: String,
    },
    /// Answer to `OnloadLayerWait`.
    LayerLoaded {
        /// The onload's ticket.
        ticket: u64,
        /// The layer waited for.
        layer: u32,
        /// Layers `0..=layer` of every page the onload copies are in GPU memory. `false`: the
        /// onload stopped first (cancelled, or a copy failed); `OnloadWait` says which pages.
        complete: bool,
    },
    /// One result per action of an `Act`'s envelope, in order.
    Acted {
        /// The envelope's `message_id`.
        message_id: String,
        /// In action order.
        results: Vec<crate::pull::ActionResult>,
    },
    /// The request failed; nothing it would have changed was changed.
    Error {
        /// Category.
        code: ErrorCode,
        /// What happened and what to do.
        message: String,
    },
}

impl Op {
    /// The kind of this request for metrics (`Hello` after the handshake counts as `Other`).
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Register { .. } => OpKind::Register,
            Op::Put { .. } => OpKind::Put,
            Op::Alloc { .. } => OpKind::Alloc,
            Op::Commit { .. } => OpKind::Commit,
            Op::Abort { .. } => OpKind::Abort,
            Op::Get { .. } => OpKind::Get,
            Op::Release { .. } => OpKind::Release,
            Op::Exists { .. } => OpKind::Exists,
            Op::Delete { .. } => OpKind::Delete,
            Op::Touch { .. } => OpKind::Touch,
            Op::Clear { .. } => OpKind::Clear,
            Op::Stats => OpKind::Stats,
            Op::Histograms => OpKind::Histograms,
            Op::Hello { .. } | Op::Cluster => OpKind::Other,
            Op::AttachRegion { .. } | Op::DetachRegion { .. } => OpKind::Region,
            Op::GetToRegion { .. } => OpKind::GetToRegion,
            Op::PutFromRegion { .. } => OpKind::PutFromRegion,
            Op::Pull { .. } => OpKind::Pull,
            Op::Wait { .. } => OpKind::Wait,
            Op::Cancel { .. } => OpKind::Cancel,
            Op::Timeouts => OpKind::Timeouts,
            Op::Act { .. } => OpKind::Act,
            Op::AttachGpu(_) => OpKind::AttachGpu,
            Op::Offload(_) => OpKind::Offload,
            Op::Onload(_)
            | Op::OnloadAsync(_)
            | Op::OnloadWait { .. }
            | Op::OnloadCancel { .. }
            | Op::OnloadLayerWait { .. } => OpKind::Onload,
        }
    }
}
