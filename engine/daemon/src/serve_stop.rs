//! What `serve` does around a restart: take a running daemon's DRAM tier over at start,
//! run write-behind (`spill.lag`, a target, not a bound), and at stop either hand the tier to a successor or flush
//! DRAM-only blocks to the spill tier within a budget.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_engine::dram::{DramTier, TierConfig};
use kvnode_engine::engine::Handover;
use kvnode_engine::residency::Announcer;
use kvnode_engine::{Engine, EngineConfig};

use crate::takeover::{Accepted, Pending, SendError};

use crate::takeover::takeover_limit;

/// `--takeover`: asks the daemon on the socket for its DRAM tier. `None`: start cold (no
/// daemon there, or its image did not fit and it stopped with a flush instead).
/// A live image is built into a tier announcing through `announcer` while the old daemon
/// serves.
pub fn take_over(
    cfg: &EngineConfig,
    announcer: &Arc<Announcer>,
) -> anyhow::Result<Option<(Handover, UnixListener)>> {
    let limit = takeover_limit(cfg);
    let t = Instant::now();
    kvnode_engine::api::check_socket_dir(&cfg.socket, cfg.allow_shared_socket_dir)?;
    let build = |image: &[u8]| {
        DramTier::restore(&tier_config(cfg), Arc::clone(announcer), image)
            .map_err(|e| e.to_string())
    };
    let Some(mut got) = crate::takeover::request(cfg, limit, &build)? else {
        tracing::info!(socket = %cfg.socket.display(), "--takeover: no daemon listens for a takeover there; starting cold");
        return Ok(None);
    };
    let donor = got.donor;
    if let Err(why) = check(cfg, &mut got.handover) {
        tracing::error!(donor, reason = %why, "the handed-over DRAM tier does not fit; the old daemon flushes to NVMe and exits, this one starts cold");
        // This process starts cold in its place: the service's main process from now on.
        crate::sd_notify::notify(&format!("MAINPID={}", std::process::id()));
        got.refuse(&why);
        wait_gone(donor, limit);
        return Ok(None);
    }
    let blocks = got.blocks;
    // Under systemd this process becomes the service's main process before the old one is
    // released to exit (0): were the main process to exit first, systemd would stop the
    // service and kill this one with it.
    crate::sd_notify::notify(&format!("MAINPID={}", std::process::id()));
    // The donor closes its spill files (unlocking them) before it lets go of the socket.
    let (h, l) = got.release(limit)?;
    tracing::info!(
        donor,
        blocks,
        elapsed_ms = t.elapsed().as_millis() as u64,
        "took over the DRAM tier"
    );
    Ok(Some((h, l)))
}

/// The DRAM tier's shape under `cfg`.
fn tier_config(cfg: &EngineConfig) -> TierConfig {
    TierConfig {
        capacity: arena_len(cfg),
        slab_bytes: cfg.slab_bytes(),
        policy: cfg.eviction,
    }
}

fn arena_len(cfg: &EngineConfig) -> u64 {
    if cfg.hugetlb {
        cfg.dram.div_ceil(2 << 20) * (2 << 20)
    } else {
        cfg.dram
    }
}

/// The memfd has the arena's size, and the image fits this configuration: a dry run of
/// the restore, or (a live takeover) the delta applied to the tier built from the live
/// image.
fn check(cfg: &EngineConfig, h: &mut Handover) -> Result<(), String> {
    let len = arena_len(cfg);
    let have = h.arena.metadata().map_err(|e| e.to_string())?.len();
    if have != len {
        return Err(format!(
            "the arena has {have} bytes, this configuration {len}"
        ));
    }
    if let Some(dram) = &h.dram {
        let t = Instant::now();
        let slots = dram.apply_delta(&h.image).map_err(|e| e.to_string())?;
        tracing::info!(
            slots,
            delta_bytes = h.image.len(),
            elapsed_us = t.elapsed().as_micros() as u64,
            "applied the slots changed while the tier was built"
        );
        h.image = Vec::new();
        return Ok(());
    }
    DramTier::restore(&tier_config(cfg), Announcer::new(None), &h.image)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Waits until process `pid` has exited (its descriptors, and with them its spill-file
/// locks, are gone: a zombie counts as gone), at most `limit`.
fn wait_gone(pid: u32, limit: Duration) {
    let t = Instant::now();
    let stat = format!("/proc/{pid}/stat");
    while t.elapsed() < limit {
        match std::fs::read_to_string(&stat) {
            Err(_) => return,
            Ok(s) => {
                let state = s
                    .rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next());
                if matches!(state, Some("Z" | "X")) {
                    return;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    tracing::warn!(pid, "the old daemon has not exited yet");
}

/// Binds the takeover socket; without it this daemon still serves (and flushes at stop).
pub fn listen_for_takeover(
    engine: &Engine,
    tx: tokio::sync::mpsc::Sender<Pending>,
) -> Option<std::path::PathBuf> {
    let dram = Arc::downgrade(engine.store.dram());
    match crate::takeover::listen(&engine.config, dram, tx) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "takeover disabled: this daemon cannot hand its DRAM tier to a successor (a stop flushes it to the spill tier instead)");
            None
        }
    }
}

/// Under systemd (`Type=notify`): ready (after a takeover, `MAINPID=` was sent already,
/// before the old daemon was released).
pub fn notify_ready() {
    crate::sd_notify::notify("READY=1");
}

/// Starts write-behind when `spill.lag` is set (the lag is a target, not a bound).
pub fn spawn_write_behind(
    engine: &Engine,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let lag = engine.config.spill.lag?;
    if engine.store.spill_phase() == kvnode_engine::store::SpillPhase::Off {
        return None;
    }
    tracing::info!(
        lag_ms = lag.as_millis() as u64,
        "write-behind on: every DRAM block is copied to NVMe, aiming at the lag (a target: puts are not slowed)"
    );
    kvnode_engine::store::spawn_write_behind(Arc::clone(&engine.store), lag, stop)
}

/// Stopping on a signal (`by_signal`; not for a successor): tells systemd, then copies DRAM
/// blocks down while serving (a second SIGTERM or SIGINT cuts that short).
pub async fn stopping(
    engine: &Arc<Engine>,
    by_signal: bool,
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
) -> Precopied {
    if !by_signal {
        return Precopied::default();
    }
    crate::sd_notify::notify("STOPPING=1");
    let again = async {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    copy_down_while_serving(engine, again).await
}

/// SIGTERM or SIGINT with a spill tier: DRAM blocks without a copy on NVMe are copied
/// down while clients are still served (store/flush.rs), so the service stops only for
/// what is committed meanwhile (the stop-time flush). Uses up to three quarters of
/// `flush_on_stop_s`; `again` (a second signal) ends it. Returns the time spent (zero:
/// nothing ran, and the stop-time flush walks every block).
async fn copy_down_while_serving(
    engine: &Arc<Engine>,
    again: impl std::future::Future<Output = ()>,
) -> Precopied {
    let budget = engine.config.spill.flush_on_stop_s;
    if budget <= 0.0 || engine.store.spill_phase() == kvnode_engine::store::SpillPhase::Off {
        return Precopied::default();
    }
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(budget * 0.75);
    tokio::pin!(again);
    tokio::select! {
        _ = tokio::time::timeout_at(deadline.into(), engine.store.spill_settled()) => {}
        () = &mut again => return Precopied { spent: t0.elapsed(), walked: false },
    }
    let r = engine.store.copy_while_serving(deadline, again).await;
    tracing::info!(
        copied = r.copied,
        committed_meanwhile = r.since,
        failed = r.failed,
        timed_out = r.timed_out,
        elapsed_ms = t0.elapsed().as_millis() as u64,
        "copied DRAM blocks to NVMe while serving; stopping the service for the rest"
    );
    Precopied {
        spent: t0.elapsed(),
        walked: r.walked,
    }
}

/// What the copy while serving left for the stop-time flush.
#[derive(Debug, Clone, Copy, Default)]
pub struct Precopied {
    /// Time spent (from the flush's budget).
    pub spent: Duration,
    /// Every block already in DRAM was walked: only what was queued since is left.
    pub walked: bool,
}

/// How a serving round ended.
#[derive(Debug)]
pub enum Stopped {
    /// A successor took the tier (keep this until the spill files are closed).
    HandedOver(Accepted),
    /// Stopped for good (signal, or a successor that starts cold in this one's place):
    /// DRAM-only blocks were flushed.
    Flushed,
    /// A successor went away mid-hand-over (or this daemon could not hand over and told it
    /// so): nobody replaces this daemon, so it serves again.
    Resume,
}

/// After the last request: hands the DRAM tier to `successor` if there is one and it takes
/// it; otherwise writes DRAM-only blocks to the spill tier within `flush_on_stop_s` — except
/// when the successor went away, or was told this daemon cannot hand over: then nobody
/// takes this daemon's place and it resumes serving.
pub async fn hand_over_or_flush(
    engine: &Arc<Engine>,
    successor: Option<Pending>,
    listener: &OwnedFd,
    pre: Precopied,
) -> Stopped {
    // A spill tier still being recovered holds its files until it is done: a successor
    // needs them closed, and the flush needs the tier (store/lower.rs).
    if engine.store.spill_phase() == kvnode_engine::store::SpillPhase::Recovering {
        tracing::info!("waiting for the spill tier's recovery to end before stopping");
    }
    engine.store.spill_settled().await;
    if let Some(p) = successor {
        match hand_over(engine, p, listener).await {
            Ok(a) => return Stopped::HandedOver(a),
            Err(HandOver::Resume(why)) => {
                tracing::error!(reason = %why, "takeover did not happen; serving again");
                return Stopped::Resume;
            }
            Err(HandOver::Stop(why)) => {
                tracing::error!(reason = %why, "takeover failed; the successor starts cold: stopping normally");
            }
        }
    }
    flush(engine, pre).await;
    Stopped::Flushed
}

/// Why a hand-over did not happen, and what this daemon does then.
enum HandOver {
    Resume(String),
    Stop(String),
}

async fn hand_over(
    engine: &Arc<Engine>,
    p: Pending,
    listener: &OwnedFd,
) -> Result<Accepted, HandOver> {
    let live = p.live();
    let failed = |p: Pending, why: String| {
        engine.store.dram().stop_tracking();
        p.fail(&why);
        Err(HandOver::Resume(why))
    };
    if let Some(t) = engine.store.nvme()
        && !t.wait_idle(Duration::from_secs(10)).await
    {
        return failed(p, "spill IO still in flight after 10 s".into());
    }
    let h = match engine.handover(live) {
        Ok(h) => h,
        Err(e) => return failed(p, e),
    };
    let blocks = engine.store.dram().blocks();
    let limit = takeover_limit(&engine.config);
    let t = Instant::now();
    let a = tokio::task::block_in_place(|| p.send(&h, listener, blocks, limit)).map_err(
        |e| match e {
            SendError::Refused(_) => HandOver::Stop(e.to_string()),
            SendError::Gone(_) => HandOver::Resume(e.to_string()),
        },
    )?;
    tracing::info!(
        blocks,
        live,
        image_bytes = h.image.len(),
        elapsed_ms = t.elapsed().as_millis() as u64,
        "DRAM tier handed over; closing the spill files and exiting"
    );
    Ok(a)
}

/// The stop-time flush (fallback when no successor takes the tier), within what is left
/// of `flush_on_stop_s` after copying while serving (`pre`).
async fn flush(engine: &Arc<Engine>, pre: Precopied) {
    let budget = engine.config.spill.flush_on_stop_s - pre.spent.as_secs_f64();
    let Some(t) = engine.store.nvme() else {
        return;
    };
    if budget <= 0.0 {
        return;
    }
    let _ = t.wait_idle(Duration::from_secs(5)).await;
    let t0 = Instant::now();
    let budget = Duration::from_secs_f64(budget);
    // After a copy while serving only what was queued since is left to write.
    let r = if pre.walked {
        engine.store.flush_queued(budget).await
    } else {
        engine.store.flush_dram(budget).await
    };
    let elapsed_ms = t0.elapsed().as_millis() as u64;
    if r.left > 0 || r.failed > 0 {
        tracing::warn!(
            copied = r.copied,
            failed = r.failed,
            left = r.left,
            timed_out = r.timed_out,
            elapsed_ms,
            "stop-time flush incomplete: blocks left only in DRAM are lost with this process"
        );
    } else {
        tracing::info!(
            copied = r.copied,
            elapsed_ms,
            "stop-time flush: every DRAM block has a copy on NVMe"
        );
    }
}
