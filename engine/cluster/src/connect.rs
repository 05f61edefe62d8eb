//! etcd connection options from `[cluster]`: timeouts, HTTP/2 keep-alive (a dead or
//! partitioned etcd is noticed without waiting for TCP), user/password, TLS.

use std::path::Path;
use std::time::Duration;

use etcd_client::ConnectOptions;

use crate::config::{ClusterConfig, EtcdUrl};
use crate::error::ClusterError;

fn read(path: &Path) -> Result<Vec<u8>, ClusterError> {
    std::fs::read(path).map_err(|source| ClusterError::File {
        path: path.display().to_string(),
        source,
    })
}

/// Connection options; reads the password and certificate files now, so a missing file
/// fails start-up instead of every later attempt.
pub fn options(cfg: &ClusterConfig, url: &EtcdUrl) -> Result<ConnectOptions, ClusterError> {
    let limit = Duration::from_millis(cfg.connect_timeout_ms);
    let ping = (cfg.ttl() / 3).max(Duration::from_millis(500));
    let mut o = ConnectOptions::new()
        .with_connect_timeout(limit)
        .with_keep_alive(ping, limit)
        .with_keep_alive_while_idle(true);
    if let (Some(user), Some(pw)) = (&cfg.user, &cfg.password_file) {
        let pw = String::from_utf8(read(pw)?)
            .map_err(|_| ClusterError::Config(format!("{} is not UTF-8 text", pw.display())))?;
        o = o.with_user(user.clone(), pw.trim_end_matches(['\r', '\n']).to_owned());
    }
    if url.tls {
        o = tls(o, cfg, url)?;
    }
    Ok(o)
}

#[cfg(feature = "tls")]
fn tls(
    o: ConnectOptions,
    cfg: &ClusterConfig,
    url: &EtcdUrl,
) -> Result<ConnectOptions, ClusterError> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let mut t = TlsOptions::new();
    if let Some(ca) = &cfg.ca_file {
        t = t.ca_certificate(Certificate::from_pem(read(ca)?));
    }
    if let (Some(c), Some(k)) = (&cfg.cert_file, &cfg.key_file) {
        t = t.identity(Identity::from_pem(read(c)?, read(k)?));
    }
    let domain = cfg.tls_domain.clone().unwrap_or_else(|| {
        let first = &url.endpoints[0];
        first
            .rsplit_once(':')
            .map_or(first.as_str(), |(h, _)| h)
            .to_owned()
    });
    Ok(o.with_tls(t.domain_name(domain)))
}

#[cfg(not(feature = "tls"))]
fn tls(_: ConnectOptions, _: &ClusterConfig, _: &EtcdUrl) -> Result<ConnectOptions, ClusterError> {
    Err(ClusterError::NoTls)
}
