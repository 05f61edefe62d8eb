//! `[cluster]` settings and the `etcd://HOST:PORT[,HOST:PORT...]/NAME` URL.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ClusterError;

/// Cluster membership settings (`[cluster]` in the daemon's config file, `--cluster URL`).
/// Only `etcd` is required; every other field has a documented default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// `etcd://HOST:PORT[,HOST:PORT...]/NAME` (plain gRPC) or `etcds://...` (TLS). NAME is
    /// the cluster: daemons with the same NAME on the same etcd see each other. Default:
    /// empty (no cluster).
    pub etcd: String,
    /// This daemon's id, unique in the cluster. Default: the host name (set it when one host
    /// runs several daemons).
    pub node_id: Option<String>,
    /// Lease time-to-live, seconds: a daemon that stops keeping its lease alive (crash,
    /// partition) leaves the membership within this. Keep-alives go out every third of it.
    /// Default: 10.
    pub ttl_s: u64,
    /// How long the last known membership stays in force after etcd stops answering,
    /// seconds; then hints to members are refused until etcd answers again. Default: 30.
    pub grace_s: f64,
    /// Connect (and per-request) limit towards etcd, milliseconds. Default: 2000.
    pub connect_timeout_ms: u64,
    /// Longest wait between two attempts to reach etcd, milliseconds (the wait doubles from
    /// 100 ms up to this). Default: 2000.
    pub retry_max_ms: u64,
    /// etcd user (etcd's own authentication). Default: none.
    pub user: Option<String>,
    /// File holding that user's password (trailing newline ignored). Default: none; the
    /// password is never taken from the command line.
    pub password_file: Option<PathBuf>,
    /// PEM CA bundle that signs etcd's server certificate (`etcds://`). Default: none.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for etcd's client-certificate authentication. Default: none.
    pub cert_file: Option<PathBuf>,
    /// PEM key of `cert_file`. Default: none.
    pub key_file: Option<PathBuf>,
    /// Server name to verify in etcd's certificate. Default: the first endpoint's host.
    pub tls_domain: Option<String>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            etcd: String::new(),
            node_id: None,
            ttl_s: 10,
            grace_s: 30.0,
            connect_timeout_ms: 2000,
            retry_max_ms: 2000,
            user: None,
            password_file: None,
            ca_file: None,
            cert_file: None,
            key_file: None,
            tls_domain: None,
        }
    }
}

/// A parsed `etcd://` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdUrl {
    /// `HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// Cluster name.
    pub name: String,
    /// `etcds://`: TLS to etcd.
    pub tls: bool,
}

impl EtcdUrl {
    /// Parses `etcd://h1:2379,h2:2379/NAME` or `etcds://...`.
    pub fn parse(s: &str) -> Result<Self, ClusterError> {
        let bad = |why: &str| ClusterError::Config(format!("cluster URL {s:?}: {why}"));
        let (tls, rest) = if let Some(r) = s.strip_prefix("etcds://") {
            (true, r)
        } else if let Some(r) = s.strip_prefix("etcd://") {
            (false, r)
        } else {
            return Err(bad("must start with etcd:// or etcds://"));
        };
        let (hosts, name) = rest
            .split_once('/')
            .ok_or_else(|| bad("missing /NAME after the endpoints"))?;
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            || name.starts_with('.')
        {
            return Err(bad(
                "NAME must be 1..=64 characters of letters, digits, '-', '_', '.'",
            ));
        }
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| bad("each endpoint needs HOST:PORT"))?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(bad("each endpoint needs HOST:PORT with a port 1..=65535"));
            }
            endpoints.push(h.to_owned());
        }
        Ok(Self {
            endpoints,
            name: name.to_owned(),
            tls,
        })
    }

    /// The endpoints as the etcd client takes them (`http://` or `https://`).
    pub fn client_endpoints(&self) -> Vec<String> {
        let scheme = if self.tls { "https" } else { "http" };
        self.endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect()
    }

    /// The key prefix of this cluster's member records.
    pub fn members_prefix(&self) -> String {
        members_prefix(&self.name)
    }
}

/// `/kvnode/clusters/NAME/members/`: every member record lives right under it.
pub fn members_prefix(name: &str) -> String {
    format!("/kvnode/clusters/{name}/members/")
}

impl ClusterConfig {
    /// Checks values that cannot work; returns the parsed URL.
    pub fn validate(&self) -> Result<EtcdUrl, ClusterError> {
        let url = EtcdUrl::parse(&self.etcd)?;
        let bad = |m: &str| Err(ClusterError::Config(m.to_owned()));
        if !(2..=3600).contains(&self.ttl_s) {
            return bad("cluster ttl_s must be 2..=3600 (etcd grants leases in whole seconds)");
        }
        if !(self.grace_s >= 0.0 && self.grace_s <= 86_400.0) {
            return bad("cluster grace_s must be 0..=86400");
        }
        if self.connect_timeout_ms == 0 || self.retry_max_ms == 0 {
            return bad("cluster connect_timeout_ms and retry_max_ms must be positive");
        }
        if self.password_file.is_some() != self.user.is_some() {
            return bad("cluster user and password_file go together");
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return bad("cluster cert_file and key_file go together");
        }
        let tls_files = self.ca_file.is_some() || self.cert_file.is_some();
        if tls_files && !url.tls {
            return bad("cluster ca_file/cert_file need an etcds:// URL");
        }
        if let Some(id) = &self.node_id
            && !valid_node_id(id)
        {
            return Err(ClusterError::Config(format!(
                "cluster node_id {id:?}: 1..=128 characters of letters, digits, '-', '_', '.', ':'"
            )));
        }
        Ok(url)
    }

    /// Lease time-to-live.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_s)
    }

    /// Grace after etcd stops answering.
    pub fn grace(&self) -> Duration {
        Duration::from_secs_f64(self.grace_s)
    }

    /// The node id in force: configured, else the host name.
    pub fn node_id(&self) -> String {
        self.node_id.clone().unwrap_or_else(host_name)
    }
}

/// Whether `s` can name a node (it becomes the last component of an etcd key).
pub fn valid_node_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// This host's name (`/proc/sys/kernel/hostname`), or `localhost`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| valid_node_id(s))
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_names_endpoints_cluster_and_tls() {
        let u = EtcdUrl::parse("etcd://10.0.0.1:2379,etcd-b:2379/prod-a").unwrap();
        assert_eq!(u.endpoints, ["10.0.0.1:2379", "etcd-b:2379"]);
        assert_eq!(u.name, "prod-a");
        assert!(!u.tls);
        assert_eq!(
            u.client_endpoints(),
            ["http://10.0.0.1:2379", "http://etcd-b:2379"]
        );
        assert_eq!(u.members_prefix(), "/kvnode/clusters/prod-a/members/");
        assert!(EtcdUrl::parse("etcds://e:2379/x").unwrap().tls);
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        for (s, why) in [
            ("http://e:2379/x", "etcd://"),
            ("etcd://e:2379", "/NAME"),
            ("etcd://e:2379/", "NAME"),
            ("etcd://e:2379/a/b", "NAME"),
            ("etcd://e/x", "HOST:PORT"),
            ("etcd://e:0/x", "port"),
            ("etcd://:2379/x", "HOST:PORT"),
        ] {
            let e = EtcdUrl::parse(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
        }
    }

    #[test]
    fn validate_refuses_settings_that_cannot_work() {
        let ok = ClusterConfig {
            etcd: "etcd://127.0.0.1:2379/t".into(),
            ..ClusterConfig::default()
        };
        assert!(ok.validate().is_ok());
        for c in [
            ClusterConfig {
                ttl_s: 1,
                ..ok.clone()
            },
            ClusterConfig {
                grace_s: -1.0,
                ..ok.clone()
            },
            ClusterConfig {
                user: Some("u".into()),
                ..ok.clone()
            },
            ClusterConfig {
                ca_file: Some("/ca.pem".into()),
                ..ok.clone()
            },
            ClusterConfig {
                node_id: Some("a/b".into()),
                ..ok.clone()
            },
        ] {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
