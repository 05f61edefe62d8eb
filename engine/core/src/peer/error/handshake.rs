//! The handshake: both daemons prove the cluster key over a transcript bound to both.

use std::fmt;
use std::net::SocketAddr;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerMsg;

use super::Verbatim;

/// Cluster key ids, shown as the daemon logs them (`0123456789abcdef, ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyIds(pub Vec<u64>);

impl fmt::Display for KeyIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, id) in self.0.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{id:016x}")?;
        }
        Ok(())
    }
}

/// Which handshake message was due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Expected {
    /// The destination's `Hello`.
    Hello,
    /// The source's `Challenge`.
    Challenge,
    /// The destination's `Auth`.
    Auth,
    /// The source's `Ready`.
    Ready,
    /// The source's answer to `UcxRequest`.
    UcxOfferOrDecline,
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Hello => "Hello",
            Self::Challenge => "Challenge",
            Self::Auth => "Auth",
            Self::Ready => "Ready",
            Self::UcxOfferOrDecline => "UcxOffer or UcxDecline",
        })
    }
}

/// The daemon a peer dialled by mistake (or through a relay), as this daemon knows itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Me {
    /// This daemon's advertised endpoint, if any.
    pub advertised: Option<Endpoint>,
    /// The address the connection was accepted on.
    pub local: SocketAddr,
}

impl fmt::Display for Me {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.advertised {
            Some(a) => write!(f, "{a}, {}", self.local),
            None => write!(f, "unnamed, {}", self.local),
        }
    }
}

/// The handshake failed, or the peer refused it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer refused us (its reason, verbatim).
    #[error("peer refused the connection: {0}")]
    Refused(Verbatim),
    /// A message other than the one the handshake was due.
    #[error("peer protocol violation: expected {expected}, got {got:?}")]
    Unexpected {
        /// The message due.
        expected: Expected,
        /// The message received.
        got: Box<PeerMsg>,
    },
    /// The peer speaks another protocol version.
    #[error(
        "peer protocol violation: peer protocol version {theirs} not supported (this daemon speaks {ours})"
    )]
    Version {
        /// The peer's.
        theirs: u32,
        /// This daemon's.
        ours: u32,
    },
    /// The source echoed the destination's nonce.
    #[error("peer authentication failed: the source echoed this daemon's nonce (a reflection)")]
    Reflection,
    /// The source chose a key this daemon does not hold.
    #[error(
        "peer authentication failed: source chose key {id:016x}, which this daemon does not hold ({held})"
    )]
    UnknownKey {
        /// The key the source chose.
        id: u64,
        /// The keys this daemon holds.
        held: KeyIds,
    },
    /// The source has no cluster key; this daemon requires one.
    #[error("peer authentication failed: source has no cluster key and this daemon requires one")]
    SourceKeyless,
    /// The source uses a cluster key; this daemon has none.
    #[error("peer authentication failed: source uses a cluster key and this daemon has none")]
    SourceKeyed,
    /// This daemon requires encryption; the source did not agree.
    #[error(
        "peer authentication failed: this daemon requires encryption and the source did not agree to it"
    )]
    EncryptionDeclined,
    /// The source's proof is wrong.
    #[error(
        "peer authentication failed: source failed the cluster-key proof for {dialled} (wrong cluster key, or not the daemon dialled: a relay?)"
    )]
    SourceProof {
        /// The endpoint dialled.
        dialled: Endpoint,
    },
    /// The destination offered no key; this daemon requires one.
    #[error("peer authentication failed: this daemon requires a cluster key")]
    KeyRequired,
    /// No key both daemons hold.
    #[error(
        "peer authentication failed: no cluster key in common: the peer holds {theirs}, this daemon {ours}"
    )]
    NoCommonKey {
        /// The peer's key ids.
        theirs: KeyIds,
        /// This daemon's.
        ours: KeyIds,
    },
    /// The destination offered keys; this daemon has none.
    #[error("peer authentication failed: this daemon has no cluster key")]
    Keyless,
    /// A keyless daemon serves loopback peers only.
    #[error("peer authentication failed: without a cluster key only loopback peers are served")]
    KeylessRemote,
    /// The destination dialled another daemon (this one is a relay's target).
    #[error(
        "peer authentication failed: the peer dialled \"{dialled}\", which is not this daemon ({me}): refusing (a relay?)"
    )]
    NotDialled {
        /// What the peer says it dialled.
        dialled: Verbatim,
        /// This daemon.
        me: Me,
    },
    /// Both nonces are equal.
    #[error("peer authentication failed: nonce collision")]
    NonceCollision,
    /// The destination's proof is wrong.
    #[error(
        "peer authentication failed: the peer failed the cluster-key proof (wrong cluster key, or a relayed or reflected proof)"
    )]
    DestinationProof,
    /// The endpoint to dial resolves to this daemon's own listener.
    #[error(
        "peer authentication failed: {target} resolves to {addr}, this daemon's own peer listener: not dialling itself"
    )]
    SelfDial {
        /// The endpoint asked for.
        target: Endpoint,
        /// The address it resolved to.
        addr: SocketAddr,
    },
}
