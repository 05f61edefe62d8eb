//! `kvnode serve`: config (defaults ← file ← flags), engine start, socket, signals, drain.

use anyhow::{Context, bail};
use kvnode_engine::EngineConfig;
use kvnode_engine::config::RegionCopy;
use kvnode_engine::policy::PolicyKind;
use kvnode_proto::size::parse_size;
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{Eviction, RegionCopyArg, ServeArgs, SpillAdmission, SpillEngineArg};
use kvnode_engine::nvme::config::{Admission, SpillDirSetting, SpillEngine};

/// Builds the effective configuration: the engine's, and the cluster's when one is named.
pub fn effective_config(
    a: &ServeArgs,
) -> anyhow::Result<(EngineConfig, Option<kvnode_cluster::ClusterConfig>)> {
    let (mut cfg, cluster) = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading config {}", p.display()))?;
            crate::cluster::split_config(&text)
                .with_context(|| format!("parsing config {}", p.display()))?
        }
        None => (EngineConfig::default(), None),
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
            Eviction::Chain => PolicyKind::Chain,
        };
    }
    cfg.pin &= !a.no_pin;
    cfg.populate &= !a.no_populate;
    cfg.hugetlb |= a.hugetlb;
    cfg.allow_shared_socket_dir |= a.allow_shared_socket_dir;
    if let Some(t) = &a.takeover_socket {
        cfg.takeover_socket = Some(t.clone());
    }
    if let Some(r) = a.region_copy {
        cfg.region_copy = match r {
            RegionCopyArg::Guarded => RegionCopy::Guarded,
            RegionCopyArg::Pread => RegionCopy::Pread,
        };
    }
    apply_tiering_flags(a, &mut cfg)?;
    if let Some(m) = &a.metrics {
        cfg.metrics = Some(m.clone());
    }
    if let Some(r) = &a.router_listen {
        cfg.router_listen = Some(r.clone());
    }
    if let Some(s) = a.lease_age_limit {
        cfg.lease_age_limit_s = s;
    }
    if let Some(s) = a.op_deadline {
        cfg.op_deadline_s = s;
    }
    crate::serve_peer::apply(&a.peer, &mut cfg.peer);
    if let Err(e) = cfg.validate() {
        bail!("invalid configuration: {e}");
    }
    let cluster = crate::cluster::effective(cluster, &a.cluster)?;
    if let Some(c) = &cluster {
        crate::cluster::check(&cfg, c).context("invalid configuration")?;
    }
    Ok((cfg, cluster))
}

/// `--spill-*` and `--events*` flags over the config file.
fn apply_tiering_flags(a: &ServeArgs, cfg: &mut EngineConfig) -> anyhow::Result<()> {
    if a.spill_dir.len() != a.spill_size.len() {
        bail!(
            "{} --spill-dir but {} --spill-size: give one size per directory",
            a.spill_dir.len(),
            a.spill_size.len()
        );
    }
    if !a.spill_dir.is_empty() {
        cfg.spill.dirs = a
            .spill_dir
            .iter()
            .zip(&a.spill_size)
            .map(|(p, s)| {
                Ok(SpillDirSetting {
                    path: p.clone(),
                    size: parse_size(s).context("--spill-size")?,
                })
            })
            .collect::<anyhow::Result<_>>()?;
    }
    if let Some(x) = a.spill_admission {
        cfg.spill.admission = match x {
            SpillAdmission::Always => Admission::Always,
            SpillAdmission::SecondRead => Admission::SecondRead,
        };
    }
    if let Some(x) = a.spill_engine {
        cfg.spill.engine = match x {
            SpillEngineArg::Uring => SpillEngine::Uring,
            SpillEngineArg::Psync => SpillEngine::Psync,
        };
    }
    if let Some(l) = &a.spill_lag {
        cfg.spill.lag = Some(
            kvnode_engine::nvme::config::parse_duration(l)
                .map_err(anyhow::Error::msg)
                .context("--spill-lag")?,
        );
    }
    if a.events.is_some() {
        cfg.events.endpoint.clone_from(&a.events);
    }
    if a.events_replay.is_some() {
        cfg.events.replay.clone_from(&a.events_replay);
    }
    if a.dp_rank.is_some() {
        cfg.events.dp_rank = a.dp_rank;
    }
    if let Some(m) = a.events_socket_mode {
        cfg.events.socket_mode = m;
    }
    if a.events_socket_group.is_some() {
        cfg.events.socket_group = a.events_socket_group;
    }
    cfg.events.tcp_readable_by_anyone |= a.events_tcp_readable_by_anyone;
    if let Some(b) = &a.events_replay_bytes {
        cfg.events.replay_ring_bytes = parse_size(b).context("--events-replay-bytes")?;
    }
    if let Some(n) = a.events_replay_len {
        cfg.events.replay_ring_len = n;
    }
    Ok(())
}

/// Binds the KV event publisher when `[events]` names an endpoint.
/// `continue_at`: the seq of the first batch when this daemon continues a predecessor's
/// stream (a takeover).
fn start_events(
    cfg: &EngineConfig,
    continue_at: Option<u64>,
) -> anyhow::Result<Option<kvnode_events::Publisher>> {
    let Some(pc) = cfg.events.publisher_config() else {
        return Ok(None);
    };
    let pc = pc.continuing_at(continue_at.unwrap_or(0));
    if let Some(seq) = continue_at {
        tracing::info!(seq, "KV events continue the previous daemon's stream");
    }
    let p = kvnode_events::Publisher::start(pc).context("starting the KV event publisher")?;
    if cfg.events.tcp_readable_by_anyone {
        tracing::warn!(
            endpoint = p.endpoint(),
            "KV EVENTS ON TCP ARE READABLE BY ANYONE WHO REACHES THE PORT (every local user included): prompt token ids of every published tenant (tcp_readable_by_anyone)"
        );
    }
    tracing::info!(endpoint = p.endpoint(), replay = ?p.replay_endpoint(), "KV events on");
    Ok(Some(p))
}

/// The publisher, continuing the stream of the daemon this one follows: a takeover's donor,
/// or a predecessor stopped on the same spill directory (its continuation is returned, for
/// the blocks to adopt once the engine runs).
fn events_after(
    cfg: &EngineConfig,
    handover: Option<&kvnode_engine::engine::Handover>,
) -> anyhow::Result<(
    Option<crate::restart_events::Continuation>,
    Option<kvnode_events::Publisher>,
)> {
    let continued = match handover {
        None => crate::restart_events::load(cfg),
        Some(_) => None,
    };
    let seq = handover
        .and_then(|h| h.events_seq)
        .or(continued.as_ref().map(|c| c.seq));
    Ok((continued, start_events(cfg, seq)?))
}

/// The engine's announcer: every block without a tenant map, else only tenants that
/// publish. With events it is pending until the publisher starts (`Announcer::attach`): a
/// live takeover builds the DRAM tier with it while the donor serves, and the publisher
/// continues the donor's seq, known only at the barrier.
fn announcer(cfg: &EngineConfig) -> std::sync::Arc<kvnode_engine::residency::Announcer> {
    use kvnode_engine::residency::Announcer;
    let policy = kvnode_engine::residency::policy::Policy::for_tenants(&cfg.tenants, cfg.dram);
    if cfg.events.publisher_config().is_some() {
        Announcer::pending(policy)
    } else {
        Announcer::with_policy(None, policy)
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVNODE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The tasks that serve beside the client socket: `/metrics`, the watchdog, the peer
/// listener (and its SIGUSR2 re-key), the cluster agent, and the test panic hook.
struct SideServices {
    metrics: Option<tokio::task::JoinHandle<()>>,
    router: Option<tokio::task::JoinHandle<()>>,
    peer_server: Option<tokio::task::JoinHandle<()>>,
    cluster_agent: Option<tokio::task::JoinHandle<()>>,
}

impl SideServices {
    async fn start(
        engine: &std::sync::Arc<kvnode_engine::Engine>,
        cluster: Option<&kvnode_cluster::ClusterConfig>,
        stop_rx: &tokio::sync::watch::Receiver<bool>,
    ) -> anyhow::Result<Self> {
        let metrics = match &engine.config.metrics {
            Some(addr) => Some(crate::metrics_http::spawn(engine, addr, stop_rx.clone()).await?),
            None => None,
        };
        let router = match &engine.config.router_listen {
            Some(addr) => Some(crate::router_http::spawn(engine, addr, stop_rx.clone()).await?),
            None => None,
        };
        tokio::spawn(std::sync::Arc::clone(engine).watchdog(stop_rx.clone()));
        if let Some(after) = crate::crash::test_panic_delay() {
            tracing::warn!(
                ?after,
                "{} is set: this daemon will panic on purpose",
                crate::crash::TEST_PANIC_ENV
            );
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                panic!("test panic requested by {}", crate::crash::TEST_PANIC_ENV);
            });
        }
        let peer_server = crate::serve_peer::start(engine, stop_rx.clone()).await?;
        crate::serve_peer::revoke_on_sigusr2(engine)?;
        let cluster_agent = match cluster {
            Some(c) => Some(crate::cluster::start(engine, c, stop_rx.clone())?),
            None => None,
        };
        Ok(Self {
            metrics,
            router,
            peer_server,
            cluster_agent,
        })
    }

    /// Waits for each to end after the stop signal.
    async fn join(self) {
        if let Some(p) = self.peer_server {
            let _ = p.await;
        }
        // Bounded: the agent revokes its lease (at most 1 s) so peers drop this node now.
        if let Some(c) = self.cluster_agent {
            let _ = c.await;
        }
        // The exporter holds the engine: its task ends (bounded) before the engine is dropped.
        if let Some(m) = self.metrics {
            let _ = m.await;
        }
        if let Some(r) = self.router {
            let _ = r.await;
        }
    }
}

/// Logs that the daemon serves (round 1: ready, notified to systemd; later rounds: again,
/// after a successor went away mid-hand-over).
fn say_serving(
    engine: &kvnode_engine::Engine,
    socket: &std::path::Path,
    round: u32,
    took_over: bool,
) {
    let blocks = engine.store.dram().blocks();
    if round == 1 {
        tracing::info!(socket = %socket.display(), dram = engine.store.arena().len(), blocks, took_over, spill = ?engine.store.spill_phase(), pid = std::process::id(), "kvnode ready");
        crate::serve_stop::notify_ready();
    } else {
        tracing::info!(socket = %socket.display(), blocks, "kvnode serving again after a takeover that did not happen");
    }
}

/// The listening socket again, from its descriptor (a later serving round).
fn relisten(fd: &std::os::fd::OwnedFd) -> anyhow::Result<tokio::net::UnixListener> {
    let l = std::os::unix::net::UnixListener::from(fd.try_clone()?);
    l.set_nonblocking(true)?;
    Ok(tokio::net::UnixListener::from_std(l)?)
}

/// A successor that continues the event stream learns where, and adopts the blocks as they
/// are announced: nothing is removed or announced again (docs/events.md "Takeover").
/// `true` when no removal is left to announce (handed over, or events off).
async fn hand_events_over(
    engine: &kvnode_engine::Engine,
    accepted: Option<&crate::takeover::Accepted>,
) -> bool {
    let quiet = !engine.store.announcer().enabled();
    let Some(a) = accepted.filter(|a| a.continues_events()) else {
        return quiet;
    };
    let limit = std::time::Duration::from_secs(5);
    if let Some(h) = engine.store.announcer().hand_over(limit, false).await {
        a.continue_events(&h);
        // This process exits once the successor serves: freeing every block's entry would
        // only delay it (the index is left the same way, `finish`).
        h.retired.leave();
        return true;
    }
    quiet
}

/// Attaches the publisher's sink to the engine's announcer. A tier built live whose donor's
/// stream is not continued (its events off, or its publisher silent): this daemon starts a
/// new stream and announces what it took over.
fn attach_events(
    announcer: &std::sync::Arc<kvnode_engine::residency::Announcer>,
    publisher: Option<&kvnode_events::Publisher>,
    handover: Option<&kvnode_engine::engine::Handover>,
) {
    let Some(p) = publisher else { return };
    announcer.attach(p.sink());
    if handover.is_some_and(|h| h.dram.is_some() && h.events_seq.is_none()) {
        let blocks = announcer.announce_registered();
        tracing::info!(
            blocks,
            "KV events: a new stream announces the blocks taken over"
        );
    }
}

/// Lets go of what the daemon held, in the order a successor relies on.
fn finish(
    engine: std::sync::Arc<kvnode_engine::Engine>,
    publisher: Option<kvnode_events::Publisher>,
    accepted: Option<crate::takeover::Accepted>,
    silent: bool,
    takeover_path: Option<&std::path::Path>,
    socket: &std::path::Path,
) {
    // After a takeover the arena stays mapped here until the successor was told to go:
    // unmapping a populated arena takes ~0.3 s per GiB of 4 KiB pages, which the
    // successor's first hit must not wait for.
    let arena = accepted
        .as_ref()
        .map(|_| std::sync::Arc::clone(engine.store.arena()));
    // Nor is the DRAM index freed (before the successor was told, or at all: freeing a
    // million blocks' entries takes tens of milliseconds, and this process exits right
    // after). Kept only when dropping it announces nothing (events off or handed over):
    // removals that are due must still be published.
    let index = silent.then(|| std::sync::Arc::clone(engine.store.dram()));
    // Nor is the arena's CUDA registration undone before the successor was told (0.85 s
    // for a 50 GiB arena on an H100 host): the process's exit drops the pins.
    if accepted.is_some() {
        engine.gpu.leave_registration();
    }
    // Dropping the engine's last handle closes the spill files (sealed, synced); the
    // publisher then sends what is queued and frees its endpoints, and lingers for its
    // subscribers while the successor (told below) starts and binds them.
    let t = std::time::Instant::now();
    drop(engine);
    tracing::info!(
        elapsed_ms = t.elapsed().as_millis() as u64,
        "engine released (spill files sealed and closed; index and arena freed unless a successor took them)"
    );
    let publisher = publisher.map(|mut p| {
        p.release(std::time::Duration::from_secs(5));
        p
    });
    if let Some(p) = takeover_path {
        let _ = std::fs::remove_file(p);
    }
    if accepted.is_none() {
        let _ = std::fs::remove_file(socket);
    }
    // The successor waits for this: the spill files are closed and unlocked now.
    drop(accepted);
    drop(arena);
    drop(publisher);
    // The process exits now: leave the index's memory to the kernel.
    std::mem::forget(index);
}

/// Runs the daemon until SIGTERM or SIGINT (or a successor takes it over), then drains and
/// returns.
pub fn run(a: &ServeArgs) -> anyhow::Result<()> {
    crate::seams::refuse_unless_switched()?;
    let (cfg, cluster) = effective_config(a)?;
    let mut shown = toml::to_string(&cfg).context("rendering config")?;
    if let Some(c) = &cluster {
        shown.push_str(&crate::cluster::render(c).context("rendering [cluster]")?);
    }
    if a.print_config {
        print!("{shown}");
        return Ok(());
    }
    init_logging();
    crate::crash::install();
    tracing::info!("effective configuration:\n{shown}");
    if let Some(why) = crate::host_mem::dram_too_large(cfg.dram) {
        tracing::warn!("{why}");
    }
    let takeover_path = crate::takeover_dir::prepare(&cfg)?;
    tracing::info!(takeover_socket = %takeover_path.display(), "takeover socket");
    // The engine's announcer; a live takeover builds the DRAM tier with it before the
    // runtime starts.
    let announcer = announcer(&cfg);
    let inherited = if a.takeover {
        crate::serve_stop::take_over(&cfg, &announcer)?
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvnode-rt")
        .build()?;
    rt.block_on(async move {
        match kvnode_engine::api::raise_fd_limit() {
            // Per-uid caps left to their defaults follow this limit ([tenants.limits]).
            Ok((soft, hard)) => tracing::info!(soft, hard, "descriptor limit raised to the hard limit"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the descriptor limit"),
        }
        let (listener, handover) = match inherited {
            Some((h, l)) => {
                l.set_nonblocking(true)?;
                (tokio::net::UnixListener::from_std(l)?, Some(h))
            }
            None => (kvnode_engine::api::bind(&cfg.socket, cfg.socket_mode, cfg.allow_shared_socket_dir)?, None),
        };
        let listener_fd = std::os::fd::AsFd::as_fd(&listener).try_clone_to_owned()?;
        let socket = cfg.socket.clone();
        let (continued, publisher) = events_after(&cfg, handover.as_ref())?;
        attach_events(&announcer, publisher.as_ref(), handover.as_ref());
        let took_over = handover.is_some();
        let engine = kvnode_engine::Engine::start_from(cfg, announcer, handover).context("starting the engine")?;
        if let Some(c) = continued {
            crate::restart_events::adopt(&engine, c);
        }
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut listener = Some(listener);
        // One round per serving period: a successor that goes away mid-hand-over leaves
        // this daemon serving again (a new round on the same listening socket).
        let mut round = 0u32;
        // Stopped by a signal (not by a successor that then started cold).
        let mut by_signal;
        let (accepted, takeover_path) = loop {
            round += 1;
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            let demoter = engine.spawn_background(stop_rx.clone());
            let write_behind = crate::serve_stop::spawn_write_behind(&engine, stop_rx.clone());
            let (takeover_tx, mut takeover_rx) = tokio::sync::mpsc::channel(1);
            let takeover_path = crate::serve_stop::listen_for_takeover(&engine, takeover_tx);
            let side = SideServices::start(&engine, cluster.as_ref(), &stop_rx).await?;
            let l = listener.take().map_or_else(|| relisten(&listener_fd), Ok)?;
            let server = tokio::spawn(kvnode_engine::api::serve(std::sync::Arc::clone(&engine), l, stop_rx));
            say_serving(&engine, &socket, round, took_over);
            let successor = tokio::select! {
                _ = term.recv() => { tracing::info!(signal = "SIGTERM", "shutting down: draining in-flight requests"); None }
                _ = int.recv() => { tracing::info!(signal = "SIGINT", "shutting down: draining in-flight requests"); None }
                Some(p) = takeover_rx.recv() => { tracing::info!(successor = p.pid(), "takeover: draining in-flight requests"); Some(p) }
            };
            by_signal = successor.is_none();
            let pre = crate::serve_stop::stopping(&engine, by_signal, &mut term, &mut int).await;
            let _ = stop_tx.send(true);
            engine.stop_background();
            server.await.context("server task")?;
            if let Some(d) = demoter {
                let _ = d.await;
            }
            if let Some(w) = write_behind {
                let _ = w.await;
            }
            let stopped = crate::serve_stop::hand_over_or_flush(&engine, successor, &listener_fd, pre).await;
            side.join().await;
            match stopped {
                crate::serve_stop::Stopped::Resume => {}
                crate::serve_stop::Stopped::HandedOver(a) => break (Some(a), takeover_path),
                crate::serve_stop::Stopped::Flushed => break (None, takeover_path),
            }
        };
        let silent = hand_events_over(&engine, accepted.as_ref()).await;
        if accepted.is_none() && by_signal {
            crate::restart_events::save(&engine).await;
        }
        finish(engine, publisher, accepted, silent, takeover_path.as_deref(), &socket);
        tracing::info!("kvnode stopped");
        anyhow::Ok(())
    })
}
