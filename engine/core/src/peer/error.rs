//! Peer errors, split by concern as redb splits its own (`src/error.rs`: a narrow enum per
//! operation, each converting into the crate's error):
//!
//! - [`WireError`]: moving sealed frames and block bytes (sockets, timeouts, tags, GETs).
//! - [`HandshakeError`]: proving the cluster key and agreeing a session.
//! - [`PullError`]: the pull protocol above a session (ordering, deadlines, busy peers).
//! - [`ConfigError`]: `[peer]` settings, the cluster key file, UCX start-up.
//!
//! [`PeerError`] holds any of them for callers that do not care which. No variant carries
//! its meaning in a `String`: the kind is the variant, the particulars are typed fields.
//! The one text field, [`Verbatim`], quotes what came from outside (a peer's refusal, a
//! configuration value) and is shown, never matched on.

mod config;
mod handshake;
mod pull;
mod wire;

use std::fmt;

use kvnode_proto::pull::{FailCode, Failure};

pub(crate) use config::list;
pub use config::{ConfigError, EntryProblem, KeyProblem, UcxSetupError, UcxStartError};
pub use handshake::{Expected, HandshakeError, KeyIds, Me};
pub use pull::{PullError, Violation};
pub use wire::{IntegrityCheck, Stage, WireError};

/// Text quoted from outside this daemon (a peer's `Refused` reason, a configuration value):
/// shown as it came, never parsed or matched on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verbatim(pub String);

impl fmt::Display for Verbatim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Verbatim {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// A peer transfer or configuration failure, by concern.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// Moving frames or block bytes failed.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The handshake failed or was refused.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The pull protocol failed.
    #[error(transparent)]
    Pull(#[from] PullError),
    /// Bad `[peer]` configuration, cluster key file or UCX set-up.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl From<std::io::Error> for PeerError {
    fn from(e: std::io::Error) -> Self {
        Self::Wire(WireError::Io(e))
    }
}

impl From<kvnode_proto::peer::PeerFrameError> for PeerError {
    fn from(e: kvnode_proto::peer::PeerFrameError) -> Self {
        Self::Wire(WireError::Frame(e))
    }
}

impl From<Violation> for PeerError {
    fn from(v: Violation) -> Self {
        Self::Pull(PullError::Violation(v))
    }
}

impl PeerError {
    /// A timeout of `stage` after `limit`.
    pub fn timeout(stage: Stage, limit: std::time::Duration) -> Self {
        Self::Wire(WireError::Timeout { stage, limit })
    }

    /// The stage that timed out, when this is a timeout.
    pub fn timed_out(&self) -> Option<Stage> {
        match self {
            Self::Wire(WireError::Timeout { stage, .. }) => Some(*stage),
            _ => None,
        }
    }

    /// Whether the socket failed or the peer closed mid-block (a pooled connection that
    /// went stale when nothing was answered yet).
    pub fn is_broken_connection(&self) -> bool {
        matches!(
            self,
            Self::Wire(WireError::Io(_) | WireError::Truncated { .. })
        )
    }

    /// Whether the peer sent bytes that are not a well-formed, authentic frame.
    pub fn is_bad_frame(&self) -> bool {
        matches!(
            self,
            Self::Wire(WireError::Frame(_) | WireError::Integrity(_))
        )
    }

    /// The failure code a client sees for keys this error failed.
    pub fn code(&self) -> FailCode {
        match self {
            Self::Wire(e) => e.code(),
            Self::Handshake(_) => FailCode::PeerRefused,
            Self::Pull(e) => e.code(),
            Self::Config(e) => e.code(),
        }
    }

    /// This error as a client-visible failure.
    pub fn failure(&self) -> Failure {
        Failure::new(self.code(), self.to_string())
    }
}

#[cfg(test)]
mod tests;
