//! The pull protocol above an authenticated session.

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerMsg;
use kvnode_proto::pull::FailCode;
use kvnode_ucx::UcxError;

use crate::dram::TierError;

/// Well-formed frames out of the pull protocol's order, from either side.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// An answer names a request or key index never asked for.
    #[error("answer for unknown key {req}/{idx}")]
    UnknownKey {
        /// Request id.
        req: u64,
        /// Key index in the request.
        idx: u32,
    },
    /// A key answered a second time.
    #[error("key {key} answered twice")]
    AnsweredTwice {
        /// Op key index.
        key: usize,
    },
    /// A block hash of the wrong length.
    #[error("block hash of a bad length ({len} bytes)")]
    HashLength {
        /// Bytes received.
        len: usize,
    },
    /// `Done` for a request never sent (or already done).
    #[error("Done for unknown request {req}")]
    UnknownRequest {
        /// Request id.
        req: u64,
    },
    /// `Done` while some of its keys were not answered.
    #[error("request {req} ended with keys unanswered")]
    Unanswered {
        /// Request id.
        req: u64,
    },
    /// A message a source never sends during a pull.
    #[error("unexpected {got:?} from a source")]
    FromSource {
        /// The message.
        got: Box<PeerMsg>,
    },
    /// A `Resolved` that does not answer the `Resolve` sent (another request id, or not one
    /// digest per hash).
    #[error(
        "resolve answer for request {req} with {got} digests; asked request {want_req} for {want}"
    )]
    ResolveAnswer {
        /// Request id answered.
        req: u64,
        /// Digests answered.
        got: usize,
        /// Request id asked.
        want_req: u64,
        /// Hashes asked.
        want: usize,
    },
    /// A message a destination never sends.
    #[error("unexpected {got:?} from a destination")]
    FromDestination {
        /// The message.
        got: Box<PeerMsg>,
    },
    /// `Landed` for a request whose leases are not held.
    #[error("Landed for request {req}, which holds nothing")]
    LandedUnheld {
        /// Request id.
        req: u64,
    },
    /// The source's requests ended while GETs were still in flight.
    #[error("requests ended with GETs in flight")]
    GetsOutlivedRequests,
    /// A `Slot` on a connection that did not negotiate UCX.
    #[error("a Slot answer on a connection that did not negotiate UCX")]
    SlotWithoutUcx,
    /// A block body on a UCX connection (answers there are `Slot`s).
    #[error("a block body arrived on a UCX connection (answers must be Slots)")]
    BodyOnUcx,
    /// A UCX offer on a connection that did not ask for one.
    #[error("a UCX offer on a connection that did not ask for UCX")]
    OfferWithoutUcx,
    /// A new UCX key while GETs under the old one are in flight.
    #[error("a new UCX key while GETs are in flight")]
    RekeyInFlight,
    /// A slot outside the arena the source registered.
    #[error("slot of {len} bytes at an address outside the source's registered arena")]
    SlotOutsideArena {
        /// Bytes of the slot.
        len: usize,
    },
    /// A GET landed for a key not in flight.
    #[error("a GET landed for key {key}, not in flight")]
    GetNotInFlight {
        /// Op key index (the GET's tag).
        key: usize,
    },
    /// GETs in flight on a connection without UCX (a bug).
    #[error("GETs in flight on a TCP connection")]
    GetsOnTcp,
    /// The source withdrew its UCX exposure mid-connection.
    #[error("UCX exposure withdrawn mid-connection")]
    ExposureWithdrawn,
}

/// A pull failed above the wire.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PullError {
    /// Well-formed frames out of protocol order.
    #[error("peer protocol violation: {0}")]
    Violation(#[from] Violation),
    /// The op's deadline passed while its small pull was received in place (on the
    /// request's own thread): the pull was abandoned and its connection closed.
    #[error("op deadline passed mid-pull; this small pull was abandoned and its connection closed")]
    Deadline,
    /// Every connection to the peer is busy (it may be frozen).
    #[error("peer {peer} is busy: every connection is held by pulls in flight (frozen peer?)")]
    Busy {
        /// The peer.
        peer: Endpoint,
    },
    /// GETs neither completed nor were handed back by UCX: their destination memory is
    /// retired.
    #[error(
        "peer GET could not be cancelled: {gets} GETs from {peer} were never handed back by UCX (their slots are retired, never reused)"
    )]
    Stuck {
        /// GETs kept by UCX.
        gets: usize,
        /// The peer.
        peer: Endpoint,
    },
    /// A GET timed out and even its cancel did not complete.
    #[error("peer GET could not be cancelled: {0} (its slot is retired, never reused)")]
    GetStuck(#[source] UcxError),
    /// The source offered UCX and no endpoint to it could be opened.
    #[error("cannot open a UCX endpoint to the peer: {0}")]
    UcxConnect(#[source] UcxError),
    /// The source's UCX key could not be packed.
    #[error("UCX key unavailable: {0}")]
    UcxKey(#[source] UcxError),
    /// The thread hashing a pull's blocks as they land stopped (it panicked).
    #[error("the pull's hashing thread stopped")]
    HashThreadStopped,
    /// The op's namespace is gone from this daemon.
    #[error("the pull's namespace: {0}")]
    Namespace(#[source] TierError),
}

impl PullError {
    /// The failure code a client sees.
    pub fn code(&self) -> FailCode {
        match self {
            Self::Violation(_) | Self::UcxKey(_) | Self::Namespace(_) | Self::HashThreadStopped => {
                FailCode::PeerFailed
            }
            Self::Deadline => FailCode::Deadline,
            Self::Busy { .. } => FailCode::PeerBusy,
            Self::Stuck { .. } | Self::GetStuck(_) | Self::UcxConnect(_) => {
                FailCode::PeerUnreachable
            }
        }
    }
}
