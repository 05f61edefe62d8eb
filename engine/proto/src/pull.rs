//! Client-visible pull operations: per-key outcomes, op reports and declared timeouts.

use serde::{Deserialize, Serialize};

/// What happened to one key of a get-with-hint (or `Pull`) operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeyOutcome {
    /// Already in the local DRAM tier.
    HitLocal,
    /// Pulled from the peer, verified and committed (and copied into the op's buffer, if any).
    Pulled,
    /// Still in flight (only in reports taken before the op ended).
    Pending,
    /// The peer does not hold it.
    Missed,
    /// Not usable: why, as a code a connector can act on and a message for people.
    Failed(Failure),
}

/// Why a key (or a whole op) failed: a stable code and a human message beside it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// What went wrong, for programs.
    pub code: FailCode,
    /// What went wrong, for people (free text; do not parse).
    pub message: String,
}

impl Failure {
    /// A failure with `code` and `message`.
    pub fn new(code: FailCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

/// Failure codes of hinted operations (docs/client-protocol.md, "Failure codes"). New codes
/// may be added; a client treats an unknown code like `PeerFailed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FailCode {
    /// The hint could not be parsed or names an unusable endpoint (fix the router or client).
    MalformedHint,
    /// The hint names a peer this daemon does not trust (or this daemon itself).
    NotAuthorized,
    /// The key lies beyond the hint's block hashes.
    NotCovered,
    /// The peer could not be reached, or the connection failed mid-transfer.
    PeerUnreachable,
    /// Every connection to the peer is busy, or too many keys are already in flight to it.
    PeerBusy,
    /// The peer refused the request or failed authentication.
    PeerRefused,
    /// The peer broke the protocol (bad frame, unexpected answer).
    PeerFailed,
    /// The op's deadline passed before the key arrived (it may still land locally later).
    Deadline,
    /// The client cancelled the op.
    Cancelled,
    /// The pulled bytes failed verification; nothing was committed.
    Checksum,
    /// The block arrived but could not be stored or copied locally (no space, size mismatch,
    /// unknown namespace).
    LocalStore,
}

/// Lifecycle state of an operation: `Pulling -> {Done | Partial | Failed | Cancelled}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OpState {
    /// Transfers in flight.
    Pulling,
    /// Every key is a local hit or pulled.
    Done,
    /// A non-empty leading run is usable; some keys are not.
    Partial,
    /// The first key is not usable.
    Failed,
    /// Cancelled by the client; the fence is in force.
    Cancelled,
}

impl OpState {
    /// Whether the op has ended (its buffers will not be written again).
    pub fn is_terminal(self) -> bool {
        !matches!(self, OpState::Pulling)
    }
}

/// A snapshot of an operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpReport {
    /// Operation id (for `Wait` and `Cancel`).
    pub op: u64,
    /// State.
    pub state: OpState,
    /// Per key, in request order.
    pub results: Vec<KeyOutcome>,
    /// Length of the leading run of `HitLocal`/`Pulled`: the usable answer.
    pub leading: u32,
    /// The peer pulled from (`tcp://host:port`), if a pull was started.
    pub peer: Option<String>,
    /// Why the hint was refused or the op failed as a whole, if it was.
    pub reason: Option<Failure>,
    /// Milliseconds from submission to the report.
    pub elapsed_ms: f64,
    /// Results of the other actions of the request's hint envelope (besides the `kv.fetch`
    /// this op follows), in envelope order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<ActionResult>,
}

/// Measured pull latency figures for one (peer, page-size bucket).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PullFigures {
    /// Peer endpoint.
    pub peer: String,
    /// Page bytes, rounded up to a power of two.
    pub page_bytes: u64,
    /// Pulls measured.
    pub samples: u64,
    /// Time to the first answered block, p50 / p99 / max, milliseconds.
    pub first_p50_ms: f64,
    /// See `first_p50_ms`.
    pub first_p99_ms: f64,
    /// See `first_p50_ms`.
    pub first_max_ms: f64,
    /// Time per further block, p50 / p99, milliseconds.
    pub per_page_p50_ms: f64,
    /// See `per_page_p50_ms`.
    pub per_page_p99_ms: f64,
    /// Cold connections: connect + authentication, p99, milliseconds.
    pub connect_p99_ms: f64,
}

/// The daemon's declared prefetch timeout model: wait `base_s + per_page_s * pages`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TimeoutReport {
    /// Fixed part, seconds.
    pub base_s: f64,
    /// Per page, seconds.
    pub per_page_s: f64,
    /// The formula, in words.
    pub formula: String,
    /// Whether measurements back the figures (false: defaults in force).
    pub measured: bool,
    /// The figures behind it.
    pub figures: Vec<PullFigures>,
}

/// What the daemon did with one action.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionResult {
    /// The action's `action_id`.
    pub action_id: String,
    /// The action's `action_type`.
    pub action_type: String,
    /// What happened.
    pub outcome: ActionOutcome,
}

/// The outcome of one action.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActionOutcome {
    /// Executed: `blocks` of the request's keys were affected, `unmatched` named hashes
    /// matched none of the request's keys or were not held where the action needs them.
    Done {
        /// Keys acted on.
        blocks: u32,
        /// Keys named but not acted on (not held, not matched, or over a bound).
        skipped: u32,
        /// What was skipped and why, when anything was.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        note: String,
    },
    /// Started in the background (a promotion from NVMe): `blocks` keys are on their way
    /// into DRAM.
    Started {
        /// Keys being promoted.
        blocks: u32,
        /// Keys named but not promoted (in DRAM already, on no tier here, or not matched).
        skipped: u32,
    },
    /// A pull was started (or refused inside its report); follow it with `Wait`.
    Pulling(Box<OpReport>),
    /// Not executed; nothing it would have changed was changed.
    Refused {
        /// Category.
        code: Refusal,
        /// Why, naming the action.
        message: String,
    },
}

/// Why an action was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// The daemon does not execute this action type or version, or lacks what it needs (an
    /// NVMe tier for `kv.demote`).
    Unsupported,
    /// The payload is invalid (the message names the field).
    Invalid,
    /// The namespace handle is unknown to this connection.
    UnknownNamespace,
    /// The router entry could not learn from the named source which pages its hashes name
    /// (unreachable, not an authorized peer, or it refused); the message says which.
    SourceFailed,
}
