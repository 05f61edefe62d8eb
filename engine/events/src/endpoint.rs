//! Event endpoints: `ipc://PATH` (a Unix socket whose file mode and group decide who reads)
//! or `tcp://HOST:PORT` (readable by anyone who reaches the port; allowed only by an
//! explicit switch, see [`Access`](crate::config::Access)).

use std::fmt;
use std::path::PathBuf;

/// Longest socket path a Unix socket address holds (`sun_path` minus its NUL).
pub const MAX_IPC_PATH: usize = 107;

/// Where a publisher socket binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://HOST:PORT`; port 0 picks a free port.
    Tcp {
        /// Host or address as written (brackets kept for IPv6).
        host: String,
        /// Port.
        port: u16,
    },
    /// `ipc:///absolute/path`: a Unix socket file created with the configured mode.
    Ipc(PathBuf),
}

/// Why an endpoint string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Neither `ipc://` nor `tcp://`.
    #[error("{0:?} is neither ipc://PATH nor tcp://HOST:PORT")]
    Scheme(String),
    /// `tcp://` without `:PORT`, with an empty host or a port outside 0..=65535.
    #[error("{0:?} is not tcp://HOST:PORT with a port in 0..=65535")]
    Tcp(String),
    /// `ipc://` with a relative, empty, over-long or NUL-carrying path, or one ending in `/`.
    #[error(
        "{0:?} is not ipc:///ABSOLUTE/PATH of at most {MAX_IPC_PATH} bytes naming a file \
         (no NUL, no trailing /)"
    )]
    Ipc(String),
}

impl Endpoint {
    /// Parses `ipc:///abs/path` or `tcp://HOST:PORT`.
    pub fn parse(s: &str) -> Result<Self, EndpointError> {
        if let Some(path) = s.strip_prefix("ipc://") {
            let ok = path.starts_with('/')
                && path.len() <= MAX_IPC_PATH
                && !path.ends_with('/')
                && !path.contains('\0');
            return ok
                .then(|| Self::Ipc(PathBuf::from(path)))
                .ok_or_else(|| EndpointError::Ipc(s.to_owned()));
        }
        let rest = s
            .strip_prefix("tcp://")
            .ok_or_else(|| EndpointError::Scheme(s.to_owned()))?;
        let bad = || EndpointError::Tcp(s.to_owned());
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
        if host.is_empty() || (host.contains(':') && !bracketed) || host.contains('/') {
            return Err(bad());
        }
        let port = port.parse::<u16>().map_err(|_| bad())?;
        Ok(Self::Tcp {
            host: host.to_owned(),
            port,
        })
    }

    /// Whether this is an `ipc://` endpoint.
    pub fn is_ipc(&self) -> bool {
        matches!(self, Self::Ipc(_))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
            Self::Ipc(path) => write!(f, "ipc://{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn both_schemes_parse_and_bad_ones_are_named() {
        assert_eq!(
            Endpoint::parse("tcp://127.0.0.1:0"),
            Ok(Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 0
            })
        );
        assert!(Endpoint::parse("tcp://[::1]:5557").is_ok());
        assert_eq!(
            Endpoint::parse("ipc:///run/kvnode/events.sock"),
            Ok(Endpoint::Ipc("/run/kvnode/events.sock".into()))
        );
        for (s, want) in [
            ("udp://h:1", "neither"),
            ("h:1", "neither"),
            ("tcp://h", "tcp://HOST:PORT"),
            ("tcp://:5", "tcp://HOST:PORT"),
            ("tcp://h:70000", "tcp://HOST:PORT"),
            ("tcp://::1:5", "tcp://HOST:PORT"),
            ("ipc://relative.sock", "ABSOLUTE"),
            ("ipc://", "ABSOLUTE"),
            ("ipc:///run/kvnode/", "ABSOLUTE"),
        ] {
            let e = Endpoint::parse(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
        let long = format!("ipc:///{}", "a".repeat(MAX_IPC_PATH));
        assert!(matches!(Endpoint::parse(&long), Err(EndpointError::Ipc(_))));
    }

    fn endpoint() -> impl Strategy<Value = Endpoint> {
        prop_oneof![
            ("[a-z0-9.-]{1,20}", any::<u16>())
                .prop_map(|(host, port)| Endpoint::Tcp { host, port }),
            "(/[a-zA-Z0-9._-]{1,12}){1,6}".prop_map(|p| Endpoint::Ipc(p.into())),
        ]
    }

    proptest! {
        #[test]
        fn display_parses_back_to_the_same_endpoint(e in endpoint()) {
            prop_assert_eq!(Endpoint::parse(&e.to_string()), Ok(e));
        }

        #[test]
        fn any_string_parses_or_is_refused_without_panicking(s in "\\PC{0,40}") {
            let _ = Endpoint::parse(&s);
        }

        #[test]
        fn accepted_endpoints_round_trip(s in "(tcp|ipc)://[\\PC]{0,30}") {
            if let Ok(e) = Endpoint::parse(&s) {
                prop_assert_eq!(Endpoint::parse(&e.to_string()), Ok(e.clone()));
                if let Endpoint::Ipc(p) = &e {
                    prop_assert!(p.is_absolute() && p.as_os_str().len() <= MAX_IPC_PATH);
                }
            }
        }
    }
}
