//! Peer configuration (`[peer]` in the config file) and the endpoint allowlist.

use std::net::IpAddr;
use std::path::PathBuf;

use kvnode_proto::hint::Endpoint;

use super::error::{ConfigError, EntryProblem};
use serde::{Deserialize, Serialize};

#[cfg(feature = "test-seams")]
use super::transport::FaultPlan;

/// Peer service settings. Every field has a default; with no `listen` the daemon serves no
/// peers, and with an empty `peers` list it dials none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerConfig {
    /// `HOST:PORT` to accept peer connections on. Default: none (no peer service).
    pub listen: Option<String>,
    /// `tcp://HOST:PORT` other daemons and the router use to reach this one. Default: the
    /// listen address when it is not a wildcard.
    pub advertise: Option<String>,
    /// File holding the shared cluster key (at least 16 bytes), or two keys on two lines
    /// during a key roll; re-read on SIGHUP. Default: none, and then the daemon only talks
    /// to loopback peers.
    pub cluster_key: Option<PathBuf>,
    /// Encrypt every peer session (AES-256-GCM), for untrusted networks; a session is
    /// encrypted when either daemon asks. Default: false (every frame is still authenticated).
    pub encrypt: bool,
    /// Authorized peers: `tcp://host:port` entries or CIDRs (`10.0.0.0/8`). Default: none.
    pub peers: Vec<String>,
    /// Connect plus authentication limit, milliseconds. Default: 500.
    pub connect_timeout_ms: u64,
    /// Longest silence tolerated while answers are owed (the heartbeat), and longest a
    /// source waits for a destination to take more bytes, milliseconds. Default: 1000.
    pub io_timeout_ms: u64,
    /// Connections per peer (pulls are striped across them). Default: 0, chosen at start
    /// from the core count and the fastest link (`peer::conns`; `stats` shows the choice).
    pub connections: u32,
    /// Keys in flight per peer; more are refused at once. Default: 8192.
    pub max_outstanding_keys: u32,
    /// Keys per `Pull` frame (requests are pipelined). Default: 16.
    pub batch_keys: u32,
    /// How blocks move: `tcp` (bodies on the TCP connection), `ucx` (one-sided UCX GETs from
    /// the source's registered arena; UCX must initialize at start-up), or `auto` (UCX when
    /// it initializes, else TCP). Negotiated per connection: a peer without UCX gets TCP.
    /// Default: `tcp`.
    pub transport: TransportKind,
    /// UCX GETs each connection keeps in flight at once (the destination's read window;
    /// the source leases up to 4 requests of `batch_keys` blocks ahead). Default: 16.
    pub ucx_gets_in_flight: u32,
    /// Let UCX serve one-sided reads in software (UCX's `tcp` and shared-memory transports,
    /// which never check a memory key): every process that reaches the UCX worker can then
    /// read and overwrite the whole DRAM tier and crash the daemon. Only for a network where
    /// every host and every local user is trusted (and for tests, where no RDMA device
    /// exists). Without it a `ucx` transport needs verbs RC/DC (the NIC checks every access)
    /// and start-up fails otherwise; `auto` falls back to TCP. Default: false.
    pub ucx_insecure_software_rma: bool,
    /// Serve peers without a cluster key: the listener then authenticates nobody, and every
    /// local user (whatever the client socket's mode says) can complete its handshake on
    /// loopback and pull every block it can name. Without a key a listener needs this
    /// switch; it is refused beside a tenant map or a client allowlist. Default: false.
    pub keyless_serves_every_local_user: bool,
    /// `UCX_NET_DEVICES` for software RMA: the only network devices UCX listens and connects
    /// on. Default: none, meaning the interface that holds the `listen` address (else the
    /// `advertise` address, else the interfaces whose networks hold the `peers` entries); a
    /// daemon with none of these must name it.
    pub ucx_net_devices: Option<String>,
    /// Fault injection on dialled connections (test builds only, feature `test-seams`; see
    /// `transport::FaultPlan`). Default: none.
    #[cfg(feature = "test-seams")]
    pub debug_fault: Option<FaultPlan>,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            listen: None,
            advertise: None,
            cluster_key: None,
            encrypt: false,
            peers: Vec::new(),
            connect_timeout_ms: 500,
            io_timeout_ms: 1000,
            connections: 0,
            max_outstanding_keys: 8192,
            batch_keys: 16,
            transport: TransportKind::Tcp,
            ucx_gets_in_flight: 16,
            ucx_insecure_software_rma: false,
            keyless_serves_every_local_user: false,
            ucx_net_devices: None,
            #[cfg(feature = "test-seams")]
            debug_fault: None,
        }
    }
}

/// The peer transport asked for (`--peer-transport`, `[peer] transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Block bodies travel on the TCP connection.
    #[default]
    Tcp,
    /// One-sided UCX GETs; the daemon refuses to start if UCX does not initialize.
    Ucx,
    /// UCX when it initializes at start-up (else TCP, with a warning).
    Auto,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(Self::Tcp),
            "ucx" => Ok(Self::Ucx),
            "auto" => Ok(Self::Auto),
            o => Err(format!("peer transport {o:?}: expected tcp, ucx or auto")),
        }
    }
}

/// One allowlist entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// Exactly this endpoint.
    Endpoint(Endpoint),
    /// Any port on an address in this network.
    Cidr(IpAddr, u8),
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let m = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            u32::from(a) & m == u32::from(n) & m
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let m = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            u128::from(a) & m == u128::from(n) & m
        }
        _ => false,
    }
}

/// Whether `e` certainly names this host's loopback.
pub fn is_loopback(e: &Endpoint) -> bool {
    e.host.eq_ignore_ascii_case("localhost") || e.ip().is_some_and(|ip| ip.is_loopback())
}

impl Allowed {
    /// Parses `tcp://host:port` or `addr/bits`.
    pub fn parse(s: &str) -> Result<Self, EntryProblem> {
        if s.starts_with("tcp://") {
            return Endpoint::parse(s)
                .map(Allowed::Endpoint)
                .map_err(EntryProblem::Endpoint);
        }
        let (a, b) = s.split_once('/').ok_or(EntryProblem::Neither)?;
        let ip: IpAddr = a.parse().map_err(|_| EntryProblem::CidrAddress)?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let bits: u8 = b
            .parse()
            .ok()
            .filter(|&n| n <= max)
            .ok_or(EntryProblem::CidrBits)?;
        Ok(Allowed::Cidr(ip, bits))
    }

    /// Whether this entry admits `e`.
    pub fn admits(&self, e: &Endpoint) -> bool {
        match self {
            Allowed::Endpoint(a) => a.host.eq_ignore_ascii_case(&e.host) && a.port == e.port,
            Allowed::Cidr(net, bits) => e.ip().is_some_and(|ip| in_cidr(ip, *net, *bits)),
        }
    }

    /// Whether every endpoint this entry admits is on loopback.
    pub fn loopback_only(&self) -> bool {
        match self {
            Allowed::Endpoint(e) => is_loopback(e),
            Allowed::Cidr(IpAddr::V4(n), bits) => *bits >= 8 && n.octets()[0] == 127,
            Allowed::Cidr(IpAddr::V6(n), bits) => *bits == 128 && n.is_loopback(),
        }
    }
}

impl PeerConfig {
    /// Parses the allowlist; without a key, refuses entries that reach beyond loopback.
    pub fn allowlist(&self) -> Result<Vec<Allowed>, ConfigError> {
        let bad = |entry: &str, problem| ConfigError::Entry {
            entry: entry.into(),
            problem,
        };
        let list: Vec<Allowed> = self
            .peers
            .iter()
            .map(|p| Allowed::parse(p).map_err(|e| bad(p, e)))
            .collect::<Result<_, _>>()?;
        if self.cluster_key.is_none()
            && let Some((p, _)) = self
                .peers
                .iter()
                .zip(&list)
                .find(|(_, a)| !a.loopback_only())
        {
            return Err(bad(p, EntryProblem::NotLoopback));
        }
        Ok(list)
    }

    /// What this configuration asks of UCX (`transport::UcxSetup::resolve`).
    pub fn ucx_asked(&self) -> super::transport::UcxAsked<'_> {
        super::transport::UcxAsked {
            window: self.ucx_gets_in_flight,
            insecure_software_rma: self.ucx_insecure_software_rma,
            net_devices: self.ucx_net_devices.as_deref(),
            listen: self.listen.as_deref(),
            advertise: self.advertise.as_deref(),
            peers: &self.peers,
        }
    }

    /// Checks values that cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.allowlist()?;
        if let Some(a) = &self.advertise {
            Endpoint::parse(a).map_err(ConfigError::Advertise)?;
        }
        let range = |field, value: u32, min, max| {
            (min..=max)
                .contains(&u64::from(value))
                .then_some(())
                .ok_or(ConfigError::OutOfRange {
                    field,
                    value: u64::from(value),
                    min,
                    max,
                })
        };
        // 0 connections: chosen from the cores.
        range("connections", self.connections, 0, 64)?;
        let most_keys = kvnode_proto::peer::MAX_PULL_KEYS as u64;
        range("batch_keys", self.batch_keys, 1, most_keys)?;
        range("ucx_gets_in_flight", self.ucx_gets_in_flight, 1, 256)?;
        if self.encrypt && self.cluster_key.is_none() {
            return Err(ConfigError::EncryptWithoutKey);
        }
        if self.connect_timeout_ms == 0 || self.io_timeout_ms == 0 {
            return Err(ConfigError::ZeroTimeout);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(s: &str) -> Endpoint {
        Endpoint::parse(s).unwrap()
    }

    #[test]
    fn allowlist_admits_exact_endpoints_and_cidrs_only() {
        let e = Allowed::parse("tcp://10.0.0.5:7000").unwrap();
        assert!(e.admits(&ep("tcp://10.0.0.5:7000")));
        assert!(!e.admits(&ep("tcp://10.0.0.5:7001")));
        let c = Allowed::parse("10.1.0.0/16").unwrap();
        assert!(c.admits(&ep("tcp://10.1.200.3:1")));
        assert!(!c.admits(&ep("tcp://10.2.0.1:1")));
        assert!(!c.admits(&ep("tcp://evil.example:1")));
        assert!(Allowed::parse("10.0.0.0/33").is_err());
        assert!(Allowed::parse("garbage").is_err());
    }

    #[test]
    fn keyless_config_refuses_non_loopback_peers() {
        let mut c = PeerConfig {
            peers: vec!["127.0.0.0/8".into(), "tcp://[::1]:5".into()],
            ..PeerConfig::default()
        };
        assert!(c.validate().is_ok());
        c.peers.push("10.0.0.0/8".into());
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("only loopback")
        );
        c.cluster_key = Some("/k".into());
        assert!(c.validate().is_ok());
        c.encrypt = true;
        assert!(c.validate().is_ok());
        c.cluster_key = None;
        c.peers.pop();
        assert!(matches!(c.validate(), Err(ConfigError::EncryptWithoutKey)));
    }
}
