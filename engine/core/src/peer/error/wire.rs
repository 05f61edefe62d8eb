//! Moving sealed frames and block bytes between daemons.

use std::fmt;
use std::time::Duration;

use kvnode_proto::frame::FrameError;
use kvnode_proto::peer::PeerFrameError;
use kvnode_proto::pull::FailCode;
use kvnode_ucx::UcxError;

/// What was being waited for when a limit passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// Connecting to the peer.
    Connect,
    /// The handshake, as a whole.
    Handshake,
    /// Handing frames (and bodies) to the socket.
    Send,
    /// Handing a destination's requests to the socket.
    RequestSend,
    /// The next frame's prefix.
    Answer,
    /// A frame's header.
    FrameHeader,
    /// A frame's tag.
    FrameTag,
    /// A block's body.
    BlockBytes,
    /// A UCX GET.
    Get,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Connect => "peer connect",
            Self::Handshake => "peer handshake",
            Self::Send => "peer send",
            Self::RequestSend => "peer request send",
            Self::Answer => "peer answer",
            Self::FrameHeader => "peer frame header",
            Self::FrameTag => "peer frame tag",
            Self::BlockBytes => "peer block bytes",
            Self::Get => "peer GET",
        })
    }
}

/// Which check of the sealed channel failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IntegrityCheck {
    /// A frame's tag is shorter than the channel's.
    ShortTag,
    /// A frame header failed to open under the next sequence number.
    Frame,
    /// An encrypted block came without its tag.
    BodyTagMissing,
    /// An encrypted block body failed to open.
    Body,
}

impl fmt::Display for IntegrityCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ShortTag => "short tag",
            Self::Frame => {
                "frame failed to decrypt (altered, injected, dropped or reordered frame)"
            }
            Self::BodyTagMissing => "block without its encryption tag",
            Self::Body => "block body failed to decrypt (altered in transit)",
        })
    }
}

/// Moving frames or block bytes failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Socket I/O.
    #[error("peer I/O failed: {0}")]
    Io(#[from] std::io::Error),
    /// No progress within a limit.
    #[error("{stage} timed out after {limit:?} (peer dead or frozen?)")]
    Timeout {
        /// What was being waited for.
        stage: Stage,
        /// The limit that passed.
        limit: Duration,
    },
    /// The peer closed inside a block.
    #[error("peer closed mid-block after {got} of {want} bytes: block not committed")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the block announced.
        want: usize,
    },
    /// Undecodable frame.
    #[error("peer sent a malformed frame: {0}")]
    Frame(#[from] PeerFrameError),
    /// A frame this daemon built could not be encoded (a bug).
    #[error("cannot encode a peer frame (a bug; please report it): {0}")]
    Encode(#[source] FrameError),
    /// A sealed frame or body failed its check: altered, injected, dropped or reordered.
    #[error("peer channel integrity check failed: {0}; connection closed")]
    Integrity(IntegrityCheck),
    /// A sealed frame was asked for before the handshake sealed the connection (a bug).
    #[error("peer protocol violation: a sealed frame before the handshake")]
    Unsealed,
    /// A UCX GET failed (the endpoint closed, the peer died).
    #[error("peer GET failed: {0}")]
    Get(#[source] UcxError),
}

impl WireError {
    /// The failure code a client sees.
    pub fn code(&self) -> FailCode {
        match self {
            Self::Io(_) | Self::Timeout { .. } | Self::Truncated { .. } | Self::Get(_) => {
                FailCode::PeerUnreachable
            }
            Self::Frame(_) | Self::Encode(_) | Self::Integrity(_) | Self::Unsealed => {
                FailCode::PeerFailed
            }
        }
    }
}
