//! `kvnode serve` peer flags and the peer listener start-up.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvnode_engine::Engine;
use kvnode_engine::peer::PeerConfig;
use kvnode_engine::peer::config::TransportKind;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Peer service flags (each overrides `[peer]` in the config file).
#[derive(Debug, Args)]
pub struct PeerArgs {
    /// Accept peer pulls on HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub peer_listen: Option<String>,
    /// Endpoint other daemons and the router use for this one.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub advertise: Option<String>,
    /// Shared cluster key file, one key per line (two during a key roll; re-read on
    /// SIGHUP). Without one, only loopback peers.
    #[arg(long, value_name = "FILE")]
    pub cluster_key: Option<PathBuf>,
    /// Encrypt every peer session (AES-256-GCM), for untrusted networks.
    #[arg(long)]
    pub peer_encrypt: bool,
    /// Authorized peers: tcp://host:port or CIDR, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub peers: Vec<String>,
    /// Peer connect + authentication timeout, milliseconds.
    #[arg(long)]
    pub peer_connect_timeout_ms: Option<u64>,
    /// Peer heartbeat: longest silence while answers are owed, milliseconds.
    #[arg(long)]
    pub peer_io_timeout_ms: Option<u64>,
    /// Connections per peer a pull is striped over (default 0: one per 4 cores, up to 16,
    /// capped by the fastest NIC's speed; `kvnode stats` shows the choice).
    #[arg(long)]
    pub peer_connections: Option<u32>,
    /// How pulled blocks move: tcp, ucx (one-sided GETs; UCX must initialize) or auto.
    #[arg(long, value_name = "tcp|ucx|auto")]
    pub peer_transport: Option<TransportKind>,
    /// INSECURE: let UCX serve one-sided reads in software (UCX's TCP and shared-memory
    /// transports check no memory key: whoever reaches the worker can read and overwrite
    /// every block and crash the daemon). Only where every host and local user is trusted;
    /// UCX then listens on the peer interface only.
    #[arg(long)]
    pub peer_ucx_insecure_software_rma: bool,
    /// Serve peers without a cluster key, knowing that every local user can then pull every
    /// block (the listener authenticates nobody). Refused beside a tenant map or allowlist.
    #[arg(long)]
    pub peer_keyless_serves_every_local_user: bool,
}

/// Applies the flags over the file's `[peer]` table.
pub fn apply(a: &PeerArgs, c: &mut PeerConfig) {
    if a.peer_listen.is_some() {
        c.listen.clone_from(&a.peer_listen);
    }
    if a.advertise.is_some() {
        c.advertise.clone_from(&a.advertise);
    }
    if a.cluster_key.is_some() {
        c.cluster_key.clone_from(&a.cluster_key);
    }
    if a.peer_encrypt {
        c.encrypt = true;
    }
    if !a.peers.is_empty() {
        c.peers.clone_from(&a.peers);
    }
    if let Some(v) = a.peer_connect_timeout_ms {
        c.connect_timeout_ms = v;
    }
    if let Some(v) = a.peer_io_timeout_ms {
        c.io_timeout_ms = v;
    }
    if let Some(v) = a.peer_connections {
        c.connections = v;
    }
    if let Some(v) = a.peer_transport {
        c.transport = v;
    }
    if a.peer_ucx_insecure_software_rma {
        c.ucx_insecure_software_rma = true;
    }
    if a.peer_keyless_serves_every_local_user {
        c.keyless_serves_every_local_user = true;
    }
}

/// Re-reads the cluster key file on each SIGHUP until `stop` (a key roll without restart).
fn reload_on_sighup(engine: &Arc<Engine>, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let peers = Arc::clone(&engine.peers);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = hup.recv() => match peers.reload_keys() {
                    Ok(line) => tracing::info!("SIGHUP: {line}"),
                    Err(e) => tracing::warn!(error = %e, "SIGHUP: cluster keys not reloaded; the keys in force stay"),
                },
                _ = stop.changed() => break,
            }
        }
    });
    Ok(())
}

/// Binds the peer listener if one is configured and says how peers are authenticated.
pub async fn start(
    engine: &Arc<Engine>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<JoinHandle<()>>> {
    let p = &engine.peers;
    tracing::info!("{}", p.describe());
    reload_on_sighup(engine, stop.clone())?;
    let Some(addr) = p.config().listen.clone() else {
        return Ok(None);
    };
    let l = p
        .transport()
        .bind(&addr)
        .await
        .with_context(|| format!("binding the peer listener on {addr}"))?;
    tracing::info!(listen = %l.local_addr()?, "peer listener ready");
    Ok(Some(tokio::spawn(kvnode_engine::peer::source::serve(
        Arc::clone(&engine.peers),
        l,
        stop,
    ))))
}

/// SIGUSR2 revokes the UCX key peers hold to this daemon's arena (re-registers it and hands
/// open connections the new key): run it after rotating the cluster key or removing a member.
pub fn revoke_on_sigusr2(engine: &Arc<Engine>) -> anyhow::Result<()> {
    if engine.peers.ucx().is_none() {
        return Ok(());
    }
    let mut usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
    let engine = Arc::clone(engine);
    tokio::spawn(async move {
        while usr2.recv().await.is_some() {
            if let Err(e) = engine.peers.revoke_remote_access() {
                tracing::error!(error = %e, "SIGUSR2: revoking the UCX arena key failed");
            }
        }
    });
    Ok(())
}
