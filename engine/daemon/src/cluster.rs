//! `kvnode serve --cluster etcd://...`: the `[cluster]` table, the etcd agent
//! (kvnode-cluster) and the adapter through which its view authorizes hinted endpoints.

use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use kvnode_cluster::{ClusterConfig, Registration, View};
use kvnode_engine::{Engine, EngineConfig};
use kvnode_proto::cluster::{ClusterReport, ClusterSummary, MemberTier};
use kvnode_proto::hint::Endpoint;
use kvnode_proto::pull::{FailCode, Failure};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Cluster flags (each overrides `[cluster]` in the config file).
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Join a cluster: etcd://HOST:PORT[,HOST:PORT...]/NAME (etcds:// for TLS).
    #[arg(long, value_name = "URL")]
    pub cluster: Option<String>,
    /// This daemon's node id in the cluster (default: the host name).
    #[arg(long, value_name = "ID", requires = "cluster")]
    pub node_id: Option<String>,
    /// Lease time-to-live in seconds: a crashed daemon leaves the membership within it.
    #[arg(long, value_name = "SECONDS", requires = "cluster")]
    pub cluster_ttl: Option<u64>,
    /// Seconds the last known membership stays in force after etcd stops answering.
    #[arg(long, value_name = "SECONDS", requires = "cluster")]
    pub cluster_grace: Option<f64>,
}

/// Parses the config file's text: the engine's part, and `[cluster]` if present (the engine
/// refuses unknown tables, so `[cluster]` is taken out before it sees the rest).
pub fn split_config(text: &str) -> anyhow::Result<(EngineConfig, Option<ClusterConfig>)> {
    let mut table: toml::Table = toml::from_str(text)?;
    if !table.contains_key("cluster") {
        // Straight from the text: errors keep their line and column.
        return Ok((toml::from_str(text)?, None));
    }
    let cluster = table
        .remove("cluster")
        .map(|v| v.try_into::<ClusterConfig>().context("[cluster]"))
        .transpose()?;
    let engine = toml::Value::Table(table).try_into::<EngineConfig>()?;
    Ok((engine, cluster))
}

/// `[cluster]` with the flags applied; `None` when neither names an etcd URL.
pub fn effective(
    file: Option<ClusterConfig>,
    a: &ClusterArgs,
) -> anyhow::Result<Option<ClusterConfig>> {
    let mut c = file.unwrap_or_default();
    if let Some(u) = &a.cluster {
        c.etcd.clone_from(u);
    }
    if c.etcd.is_empty() {
        return Ok(None);
    }
    if a.node_id.is_some() {
        c.node_id.clone_from(&a.node_id);
    }
    if let Some(t) = a.cluster_ttl {
        c.ttl_s = t;
    }
    if let Some(g) = a.cluster_grace {
        c.grace_s = g;
    }
    c.validate()?;
    Ok(Some(c))
}

/// The endpoint this daemon registers: `advertise`, else a non-wildcard `listen`.
fn advertised(cfg: &EngineConfig) -> anyhow::Result<Endpoint> {
    let p = &cfg.peer;
    let a = p
        .advertise
        .clone()
        .or_else(|| {
            p.listen
                .clone()
                .filter(|l| !l.starts_with("0.0.0.0") && !l.starts_with("[::]"))
                .map(|l| format!("tcp://{l}"))
        })
        .context("a cluster member needs a peer endpoint to register: give --peer-listen HOST:PORT (not a wildcard) or --advertise tcp://HOST:PORT")?;
    Endpoint::parse(&a).map_err(|e| anyhow::anyhow!("advertise: {e}"))
}

/// Checks what `--cluster` needs of the rest of the configuration.
pub fn check(engine: &EngineConfig, c: &ClusterConfig) -> anyhow::Result<()> {
    if engine.peer.cluster_key.is_none() {
        bail!(
            "--cluster needs --cluster-key: membership in etcd names endpoints, the key authenticates them (docs/cluster.md)"
        );
    }
    advertised(engine)?;
    if engine.peer.listen.is_none() {
        bail!("a cluster member serves pulls: give --peer-listen HOST:PORT");
    }
    c.validate()?;
    Ok(())
}

/// The view as the engine's membership seam.
#[derive(Debug)]
struct EtcdMembership(Arc<View>);

impl kvnode_engine::peer::Membership for EtcdMembership {
    fn authorize(&self, e: &Endpoint) -> Result<(), Failure> {
        let v = self.0.check(&e.host, e.port);
        if v.authorizes() {
            Ok(())
        } else {
            Err(Failure::new(
                FailCode::NotAuthorized,
                v.describe(&e.to_string()),
            ))
        }
    }

    fn summary(&self) -> ClusterSummary {
        self.0.summary()
    }

    fn report(&self) -> ClusterReport {
        self.0.report()
    }
}

/// The ids of the cluster keys held now (the fingerprints the peer handshake names them by,
/// never the keys): members sharing none would fail the handshake, so hints to them are
/// refused up front. Recorded at registration; a SIGHUP key reload is not re-published.
fn key_id(engine: &Engine) -> Option<String> {
    let ring = engine.peers.keys()?;
    let ids: Vec<String> = ring.ids().iter().map(|i| format!("{i:016x}")).collect();
    Some(ids.join(","))
}

/// Starts the agent and installs its view. Never waits on etcd: when etcd is down the
/// daemon starts anyway (and says so), and the agent keeps trying.
pub fn start(
    engine: &Arc<Engine>,
    cfg: &ClusterConfig,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    let endpoint = advertised(&engine.config)?;
    let reg = Registration {
        endpoints: vec![endpoint.to_string()],
        transports: vec!["tcp".into()],
        version: env!("CARGO_PKG_VERSION").into(),
        peer_protocol: kvnode_proto::peer::PEER_PROTOCOL_VERSION,
        tiers: engine
            .stats()
            .tiers
            .into_iter()
            .map(|t| MemberTier {
                tier: t.tier,
                capacity_bytes: t.capacity_bytes,
            })
            .collect(),
        key_id: key_id(engine),
    };
    let agent = kvnode_cluster::start(cfg, reg, stop).context("starting the cluster agent")?;
    let url = cfg.etcd.as_str();
    tracing::info!(
        cluster = url,
        node = %agent.view.local().node_id,
        endpoint = %endpoint,
        ttl_s = cfg.ttl_s,
        grace_s = cfg.grace_s,
        "cluster: agent started; registering in etcd in the background (hints to members are refused until etcd answers)"
    );
    if engine
        .peers
        .set_membership(Arc::new(EtcdMembership(Arc::clone(&agent.view))))
        .is_err()
    {
        bail!("cluster membership was already installed");
    }
    Ok(agent.task)
}

/// `[cluster]` rendered for `--print-config`.
pub fn render(c: &ClusterConfig) -> anyhow::Result<String> {
    let mut t = toml::Table::new();
    t.insert("cluster".into(), toml::Value::try_from(c)?);
    Ok(toml::to_string(&t)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: Option<&str>) -> ClusterArgs {
        ClusterArgs {
            cluster: url.map(str::to_owned),
            node_id: Some("n7".into()),
            cluster_ttl: Some(4),
            cluster_grace: None,
        }
    }

    #[test]
    fn cluster_table_is_taken_out_before_the_engine_reads_the_file() {
        let (engine, cluster) = split_config(
            "dram = \"64MiB\"\n[peer]\nlisten = \"10.0.0.1:7700\"\n[cluster]\netcd = \"etcd://e:2379/a\"\ngrace_s = 9.0\n",
        )
        .unwrap();
        assert_eq!(engine.dram, 64 << 20);
        let c = cluster.unwrap();
        assert_eq!((c.etcd.as_str(), c.grace_s), ("etcd://e:2379/a", 9.0));
        // The engine still refuses tables it does not know, and [cluster] its unknown keys.
        assert!(split_config("[clusters]\netcd = \"x\"\n").is_err());
        assert!(split_config("[cluster]\netcd = \"etcd://e:2379/a\"\nttl = 3\n").is_err());
    }

    #[test]
    fn flags_override_the_file_and_no_url_means_no_cluster() {
        assert!(effective(None, &args(None)).unwrap().is_none());
        let file = ClusterConfig {
            etcd: "etcd://file:2379/a".into(),
            ..ClusterConfig::default()
        };
        let c = effective(Some(file.clone()), &args(None)).unwrap().unwrap();
        assert_eq!((c.etcd.as_str(), c.ttl_s), ("etcd://file:2379/a", 4));
        let c = effective(Some(file), &args(Some("etcd://flag:2379/b")))
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.etcd.as_str(), c.node_id.as_deref()),
            ("etcd://flag:2379/b", Some("n7"))
        );
        assert!(effective(None, &args(Some("etcd://x/b"))).is_err());
    }
}
