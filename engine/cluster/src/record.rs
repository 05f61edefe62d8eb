//! The member record: what a daemon writes under `/kvnode/clusters/NAME/members/NODE_ID`
//! (JSON, attached to its lease). Format in docs/cluster.md; unknown fields are ignored so
//! newer daemons may add some.

use serde::{Deserialize, Serialize};

use kvnode_proto::cluster::MemberTier;

/// Version of the record layout itself (not of the software or the peer protocol).
pub const RECORD_VERSION: u32 = 1;

/// One daemon's registration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemberRecord {
    /// [`RECORD_VERSION`] of the writer.
    pub record: u32,
    /// Node id (the key's last component repeats it).
    pub node_id: String,
    /// Random per daemon start: tells a restarted daemon from its predecessor, and two
    /// daemons that were given the same node id from each other.
    pub instance: String,
    /// Advertised peer endpoints (`tcp://host:port`); hints must name one of them.
    pub endpoints: Vec<String>,
    /// Transports served (`tcp`, ...).
    pub transports: Vec<String>,
    /// Software version.
    pub version: String,
    /// Peer protocol version.
    pub peer_protocol: u32,
    /// Tier capacities.
    pub tiers: Vec<MemberTier>,
    /// Identifiers of the cluster keys held at registration (64-bit fingerprints in hex,
    /// comma-separated, two during a key roll; never a key), if any.
    pub key_id: Option<String>,
    /// Wall-clock time of this registration, ms since the Unix epoch.
    pub registered_unix_ms: u64,
}

impl MemberRecord {
    /// Parses a record read from etcd; `None` for anything that is not one (logged by the
    /// caller: a stray key under the prefix must not take the membership down).
    pub fn parse(value: &[u8]) -> Option<Self> {
        let r: Self = serde_json::from_slice(value).ok()?;
        (!r.node_id.is_empty()).then_some(r)
    }

    /// The JSON written to etcd.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a member record always serializes")
    }
}

/// `host` and `port` of `scheme://host:port` (IPv6 in brackets), host lower-cased.
pub fn endpoint_host_port(s: &str) -> Option<(String, u16)> {
    let rest = s.split_once("://").map_or(s, |(_, r)| r);
    let (host, port) = rest.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().ok()?;
    (!host.is_empty()).then(|| (host.to_ascii_lowercase(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_ignores_unknown_fields() {
        let r = MemberRecord {
            record: RECORD_VERSION,
            node_id: "n1".into(),
            instance: "abc".into(),
            endpoints: vec!["tcp://10.0.0.1:7700".into()],
            transports: vec!["tcp".into()],
            version: "0.1.0".into(),
            peer_protocol: 1,
            tiers: vec![MemberTier {
                tier: "dram".into(),
                capacity_bytes: 1 << 30,
            }],
            key_id: Some("00ff".into()),
            registered_unix_ms: 5,
        };
        assert_eq!(MemberRecord::parse(&r.to_json()), Some(r.clone()));
        let mut v: serde_json::Value = serde_json::from_slice(&r.to_json()).unwrap();
        v["from_the_future"] = serde_json::json!([1, 2]);
        assert_eq!(
            MemberRecord::parse(&serde_json::to_vec(&v).unwrap()),
            Some(r)
        );
        assert_eq!(MemberRecord::parse(b"not json"), None);
        assert_eq!(MemberRecord::parse(b"{}"), None);
    }

    #[test]
    fn endpoints_compare_by_host_and_port() {
        assert_eq!(
            endpoint_host_port("tcp://Node-A:7700"),
            Some(("node-a".into(), 7700))
        );
        assert_eq!(endpoint_host_port("tcp://[::1]:9"), Some(("::1".into(), 9)));
        assert_eq!(endpoint_host_port("tcp://x"), None);
        assert_eq!(endpoint_host_port("tcp://:7"), None);
    }
}
