//! `[peer]` settings, the cluster key file and UCX start-up.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use kvnode_proto::hint::HintError;
use kvnode_proto::pull::FailCode;
use kvnode_ucx::{Resource, UcxError};

use super::Verbatim;

/// Why a `--peers` entry is not usable.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryProblem {
    /// `tcp://host:port` that does not parse.
    Endpoint(HintError),
    /// Neither `tcp://host:port` nor `addr/bits`.
    Neither,
    /// The address of a CIDR does not parse.
    CidrAddress,
    /// The prefix length of a CIDR is not a number up to 32 (IPv4) or 128 (IPv6).
    CidrBits,
    /// Beyond loopback, and this daemon has no cluster key.
    NotLoopback,
}

impl fmt::Display for EntryProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Endpoint(e) => write!(f, "{e}"),
            Self::Neither => f.write_str("is neither tcp://host:port nor a CIDR"),
            Self::CidrAddress => f.write_str("has a bad CIDR address"),
            Self::CidrBits => f.write_str("has a bad CIDR prefix length"),
            Self::NotLoopback => f.write_str(
                "is not on loopback: without --cluster-key only loopback peers are allowed",
            ),
        }
    }
}

/// Why the cluster key file is not usable.
#[derive(Debug)]
#[non_exhaustive]
pub enum KeyProblem {
    /// It cannot be opened.
    Open(std::io::Error),
    /// It cannot be stat'ed.
    Stat(std::io::Error),
    /// A FIFO, device or directory.
    NotRegular,
    /// Larger than the limit.
    TooLong {
        /// Bytes (at least; reading stops past the limit).
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// It cannot be read.
    Read(std::io::Error),
    /// Not one or two keys.
    KeyCount {
        /// Keys found.
        found: usize,
        /// Most keys a file holds.
        max: usize,
    },
    /// A key shorter than 16 bytes.
    ShortKey {
        /// Its length.
        bytes: usize,
    },
    /// The same key twice.
    Duplicate,
}

impl fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Open(e) => write!(f, "cannot open: {e}"),
            Self::Stat(e) => write!(f, "cannot stat: {e}"),
            Self::NotRegular => f.write_str(
                "not a regular file (a FIFO, device or directory); give a file holding the key",
            ),
            Self::TooLong { bytes, max } => {
                write!(f, "{bytes} bytes; a cluster key file holds at most {max}")
            }
            Self::Read(e) => write!(f, "cannot read: {e}"),
            Self::KeyCount { found, max } => write!(
                f,
                "holds {found} keys; a cluster key file holds 1 or {max} (one per line)"
            ),
            Self::ShortKey { bytes } => write!(
                f,
                "a key of {bytes} bytes; a cluster key needs at least 16 (e.g. `head -c 32 /dev/urandom | base64`)"
            ),
            Self::Duplicate => f.write_str("holds the same key twice"),
        }
    }
}

/// Why UCX cannot be confined to the peer interface (`ucx_insecure_software_rma`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UcxSetupError {
    /// No interface holds this daemon's own address.
    #[error(
        "peer ucx_insecure_software_rma: no network interface holds {0}: set [peer] ucx_net_devices"
    )]
    NoInterface(IpAddr),
    /// No local network holds a listed peer's address.
    #[error(
        "peer ucx_insecure_software_rma: no local network holds peer address {0}: set [peer] ucx_net_devices"
    )]
    NoNetworkFor(IpAddr),
    /// No address names the peer interface.
    #[error(
        "peer ucx_insecure_software_rma: UCX must listen only on the peer interface, and neither \
         --peer-listen, --advertise nor --peers names a specific address: give one, or set [peer] ucx_net_devices"
    )]
    NoAddress,
}

/// Bad `[peer]` configuration, cluster key file or UCX set-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A `--peers` entry.
    #[error("invalid peer configuration: peer {entry:?} {problem}")]
    Entry {
        /// The entry as given.
        entry: Verbatim,
        /// What is wrong with it.
        problem: EntryProblem,
    },
    /// `advertise` does not parse.
    #[error("invalid peer configuration: advertise: {0}")]
    Advertise(#[source] HintError),
    /// A number outside its range.
    #[error("invalid peer configuration: peer {field} is {value}; it must be {min}..={max}")]
    OutOfRange {
        /// The `[peer]` field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// Least allowed.
        min: u64,
        /// Most allowed.
        max: u64,
    },
    /// Encryption asked for without a cluster key.
    #[error(
        "invalid peer configuration: peer encryption needs a cluster key (without one the session keys are public)"
    )]
    EncryptWithoutKey,
    /// A zero timeout.
    #[error("invalid peer configuration: peer timeouts must be positive")]
    ZeroTimeout,
    /// The cluster key file.
    #[error("cluster key: {}: {problem}", path.display())]
    Key {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: KeyProblem,
    },
    /// A key reload on a daemon started without a key file.
    #[error("cluster key: no cluster key file is configured: a keyless daemon stays keyless")]
    NoKeyFile,
    /// UCX cannot be confined to the peer interface.
    #[error("invalid peer configuration: {0}")]
    UcxSetup(#[from] UcxSetupError),
    /// UCX did not start.
    #[error(
        "invalid peer configuration: peer transport ucx: {0} (is libucx0 installed, UCX_TLS valid and an RDMA device present? `ucx_info -d` lists the transports)"
    )]
    UcxStart(#[source] UcxError),
    /// UCX would serve remote memory access in software.
    #[error("invalid peer configuration: peer transport ucx: {0}")]
    UcxUnsafe(#[source] UcxStartError),
    /// The arena could not be registered with UCX again.
    #[error("re-registering the arena with UCX: {0}")]
    Reregister(#[source] UcxError),
}

impl ConfigError {
    /// The failure code a client sees.
    pub fn code(&self) -> FailCode {
        match self {
            Self::Key { .. } | Self::NoKeyFile => FailCode::PeerRefused,
            _ => FailCode::PeerFailed,
        }
    }
}

/// Why UCX did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UcxStartError {
    /// UCX itself failed (not installed, no usable transport, ...).
    #[error("{0}")]
    Ucx(#[from] UcxError),
    /// UCX would serve remote memory access in software (no NIC checks the memory key).
    #[error(
        "UCX would serve one-sided reads in software over {}: anyone who reaches this daemon's UCX worker \
         could read and overwrite every tenant's blocks and crash the daemon with one GET. The UCX transport \
         needs an RDMA (verbs RC/DC) device; use --peer-transport tcp, or, only on a network where every host \
         and local user is trusted, --peer-ucx-insecure-software-rma (docs/peer-protocol.md, threat model)",
        list(.0)
    )]
    SoftwareRma(Vec<Resource>),
}

/// UCX resources as the start-up line names them.
pub(crate) fn list(r: &[Resource]) -> String {
    r.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
