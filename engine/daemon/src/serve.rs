//! `kvnode serve`: config (defaults ← file ← flags), engine start, socket, signals, drain.

use anyhow::{Context, bail};
use kvnode_engine::EngineConfig;
use kvnode_engine::policy::PolicyKind;
use kvnode_proto::size::parse_size;
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{Eviction, ServeArgs};

/// Builds the effective configuration.
pub fn effective_config(a: &ServeArgs) -> anyhow::Result<EngineConfig> {
    let mut cfg = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading config {}", p.display()))?;
            toml::from_str::<EngineConfig>(&text)
                .with_context(|| format!("parsing config {}", p.display()))?
        }
        None => EngineConfig::default(),
    };
    if let Some(s) = &a.socket {
        cfg.socket.clone_from(s);
    }
    if let Some(d) = &a.dram {
        cfg.dram = parse_size(d).context("--dram")?;
    }
    if let Some(s) = &a.slab_size {
        cfg.slab_size = Some(parse_size(s).context("--slab-size")?);
    }
    if let Some(e) = a.eviction {
        cfg.eviction = match e {
            Eviction::Lru => PolicyKind::Lru,
            Eviction::S3fifo => PolicyKind::S3fifo,
        };
    }
    cfg.pin &= !a.no_pin;
    cfg.populate &= !a.no_populate;
    cfg.hugetlb |= a.hugetlb;
    crate::serve_peer::apply(&a.peer, &mut cfg.peer);
    if let Err(e) = cfg.validate() {
        bail!("invalid configuration: {e}");
    }
    Ok(cfg)
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVNODE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Runs the daemon until SIGTERM or SIGINT, then drains and returns.
pub fn run(a: &ServeArgs) -> anyhow::Result<()> {
    let cfg = effective_config(a)?;
    let shown = toml::to_string(&cfg).context("rendering config")?;
    if a.print_config {
        print!("{shown}");
        return Ok(());
    }
    init_logging();
    tracing::info!("effective configuration:\n{shown}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvnode-rt")
        .build()?;
    rt.block_on(async move {
        let listener = kvnode_engine::api::bind(&cfg.socket, cfg.socket_mode)?;
        let socket = cfg.socket.clone();
        let engine = kvnode_engine::api::Engine::start(cfg).context("starting the engine")?;
        tracing::info!(socket = %socket.display(), dram = engine.arena.len(), pid = std::process::id(), "kvnode ready");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let peer_server = crate::serve_peer::start(&engine, stop_rx.clone()).await?;
        let server = tokio::spawn(kvnode_engine::api::serve(std::sync::Arc::clone(&engine), listener, stop_rx));
        let sig = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = sig, "shutting down: draining in-flight requests");
        let _ = stop_tx.send(true);
        engine.stop_background();
        server.await.context("server task")?;
        if let Some(p) = peer_server {
            let _ = p.await;
        }
        let _ = std::fs::remove_file(&socket);
        tracing::info!("kvnode stopped");
        anyhow::Ok(())
    })
}
