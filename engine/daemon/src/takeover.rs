//! Takeover: a new daemon (`kvnode serve --takeover`) receives the running daemon's DRAM arena
//! (its memfd), its DRAM index and its listening socket, so an upgrade copies no block and
//! loses none; the running daemon serves while the successor rebuilds the index.
//!
//! ```text
//!  successor                          running daemon (donor), socket S
//!  connect T ───────────────────────> (takeover socket T: owner-only, in a 0700 directory
//!                                      apart from S's, crate::takeover_dir; same uid only)
//!  Ask {config, image format, live} ─> compatible? no: Answer{ok:false, why}, keeps serving
//!                                     live: note changed slots, image slab by slab
//!  <──────── Answer{ok, live, image_len} + live image bytes     (donor keeps serving)
//!  build the DRAM tier from it
//!  pre-copy rounds (both asked for them, dram::PRE_COPY), the donor serving:
//!  "round\n" ───────────────────────> slots changed since the image / last round
//!  <──────── Answer{ok, image_len, blocks = slots} + delta bytes
//!  apply it; again until a round is small
//!  "built\n" ───────────────────────> stop accepting, drain, stop demoter and
//!                                      write-behind, wait for spill IO in flight
//!  <──────── Answer{ok, image_len} + fds [arena memfd, listener] + delta bytes
//!  apply the delta (slots changed     (not live, an older successor: the whole image
//!  since the last round)               here instead, then a dry-run restore)
//!  "ok\n" / "failed: why\n" ───────> failed: flush DRAM to NVMe (fallback), exit
//!                                     ok: close the spill files (unlock), remove
//!                                         T, drop everything, exit
//!  <──────── EOF
//!  open spill files, serve with the built tier over the same memfd on the same listener
//! ```
//!
//! A successor that goes away (or cannot build or apply a round) before `built` leaves the
//! donor serving, its change tracking stopped. Clients that were connected to the donor see their
//! connection closed between requests at the barrier (a clear error, never wrong bytes);
//! new connections wait in the listener's backlog and are accepted by the successor.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use std::sync::{Arc, Weak};

use kvnode_engine::EngineConfig;
use kvnode_engine::dram::DramTier;
use kvnode_engine::engine::Handover;
use serde::{Deserialize, Serialize};

/// The image format this build reads and writes (the magic of `dram::image`).
const IMAGE_FORMAT: &str = "KVNDRAM1";

/// The takeover socket of the daemon configured by `cfg` (`EngineConfig::takeover_path`).
fn path_of(cfg: &EngineConfig) -> anyhow::Result<PathBuf> {
    cfg.takeover_path().map_err(anyhow::Error::msg)
}

/// Whether a process of `uid` may be the other end of a takeover: only this daemon's own
/// uid. Root is not let in unless this daemon runs as root: a root process is not the
/// service (an engine container's default user is root), and the arena holds every
/// tenant's blocks.
fn same_uid(uid: u32) -> bool {
    // SAFETY: geteuid has no preconditions.
    uid == unsafe { libc::geteuid() }
}

/// What the successor asks with.
#[derive(Debug, Serialize, Deserialize)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "a wire format: each flag is a JSON field an older build leaves out"
)]
struct Ask {
    version: String,
    pid: u32,
    dram: u64,
    slab_bytes: u64,
    hugetlb: bool,
    image_formats: Vec<String>,
    /// The successor continues the donor's KV event stream (reads `events-seq` and the
    /// NVMe announcements after its verdict). Absent from older builds: they start anew.
    #[serde(default)]
    continues_events: bool,
    /// The successor builds its tier from a live image while the donor serves, and takes the
    /// delta at the barrier. Absent from older builds (and, before 2026-12-07, off with
    /// `--events`): the donor stops first, then sends the whole image.
    #[serde(default)]
    live: bool,
    /// After its build the successor asks for pre-copy rounds (`round`) before `built`.
    /// Absent from older builds: the barrier moves every slot changed during the build.
    #[serde(default)]
    pre_copy: bool,
}

/// The donor's answer.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    ok: bool,
    error: Option<String>,
    pid: u32,
    image_len: u64,
    blocks: u64,
    /// The image is a live one: the successor builds, says `built`, and a second answer
    /// (not live) brings the descriptors and the delta.
    #[serde(default)]
    live: bool,
    /// The donor answers pre-copy rounds (the successor asked for them and this build
    /// serves them). In a round's answer, `image_len` is the delta's length and `blocks`
    /// the slots it names.
    #[serde(default)]
    pre_copy: bool,
}

fn ask_of(cfg: &EngineConfig) -> Ask {
    Ask {
        version: env!("CARGO_PKG_VERSION").into(),
        pid: std::process::id(),
        dram: cfg.dram,
        slab_bytes: cfg.slab_bytes(),
        hugetlb: cfg.hugetlb,
        image_formats: vec![IMAGE_FORMAT.into()],
        continues_events: true,
        // With events too: the tier is built under a pending announcer (registered, nothing
        // published) and its sink is attached once the barrier gives the stream's seq.
        live: true,
        pre_copy: true,
    }
}

/// Why the donor refuses `ask` (its own configuration is `cfg`), if it does.
fn incompatible(ask: &Ask, cfg: &EngineConfig) -> Option<String> {
    if !ask.image_formats.iter().any(|f| f == IMAGE_FORMAT) {
        return Some(format!(
            "the new daemon reads DRAM images {:?}, this one writes {IMAGE_FORMAT}",
            ask.image_formats
        ));
    }
    let mut diffs = Vec::new();
    if ask.dram != cfg.dram {
        diffs.push(format!("dram {} -> {}", cfg.dram, ask.dram));
    }
    if ask.slab_bytes != cfg.slab_bytes() {
        diffs.push(format!(
            "slab_size {} -> {}",
            cfg.slab_bytes(),
            ask.slab_bytes
        ));
    }
    if ask.hugetlb != cfg.hugetlb {
        diffs.push(format!("hugetlb {} -> {}", cfg.hugetlb, ask.hugetlb));
    }
    (!diffs.is_empty()).then(|| {
        format!(
            "the DRAM layout would change ({}): a takeover keeps the arena as it is. Start the new daemon with the same dram/slab_size/hugetlb, or stop this one (SIGTERM flushes DRAM to the spill tier, if any) and start cold",
            diffs.join(", ")
        )
    })
}

fn read_line(r: &mut impl BufRead, what: &str) -> anyhow::Result<String> {
    let mut line = String::new();
    let n = r
        .by_ref()
        .take(1 << 20)
        .read_line(&mut line)
        .with_context(|| format!("reading the {what}"))?;
    if n == 0 {
        bail!("the other daemon closed the takeover socket before the {what}");
    }
    Ok(line)
}

// ----- successor -----

/// What the successor received; the donor is still alive until [`Received::release`].
#[derive(Debug)]
pub struct Received {
    /// Arena memfd and DRAM image.
    pub handover: Handover,
    /// The donor's listening socket (same path, same inode).
    pub listener: UnixListener,
    /// The donor's pid.
    pub donor: u32,
    /// Blocks in the image.
    pub blocks: u64,
    stream: UnixStream,
}

impl Received {
    /// Tells the donor the image was accepted, then waits (at most `limit`) until it has
    /// closed its spill files and gone.
    pub fn release(mut self, limit: Duration) -> anyhow::Result<(Handover, UnixListener)> {
        self.stream.write_all(b"ok\n")?;
        self.stream.set_read_timeout(Some(limit))?;
        let mut rest = Vec::new();
        self.stream
            .read_to_end(&mut rest)
            .context("waiting for the old daemon to close its spill files and exit")?;
        if let Some((seq, nvme)) = continuation_of(&rest) {
            self.handover.events_seq = Some(seq);
            self.handover.nvme_announced = nvme;
        }
        Ok((self.handover, self.listener))
    }

    /// Tells the donor the image cannot be used (it flushes to NVMe and exits).
    pub fn refuse(mut self, why: &str) {
        let line = why.replace('\n', " ");
        let _ = self
            .stream
            .write_all(format!("failed: {line}\n").as_bytes());
    }
}

/// Asks the daemon on `cfg.socket` for its DRAM tier. `Ok(None)`: no daemon listens for a
/// takeover there (start cold). An error: it refused, nothing changed on its side.
/// With a live image, `build` rebuilds the tier from it while the donor keeps serving.
pub fn request(
    cfg: &EngineConfig,
    limit: Duration,
    build: &dyn Fn(&[u8]) -> Result<DramTier, String>,
) -> anyhow::Result<Option<Received>> {
    let path = path_of(cfg)?;
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to {}", path.display())),
    };
    // Whoever answers must be a kvnode of this uid: anyone else who bound the takeover
    // socket would hand us its tier (blocks of its choosing under any key).
    let cred = kvnode_fdpass::peer_cred(stream.as_raw_fd())
        .with_context(|| format!("reading SO_PEERCRED of {}", path.display()))?;
    if !same_uid(cred.uid) {
        bail!(
            "the process answering on {} (pid {}) runs as uid {}, not as this daemon's uid {}: refusing its DRAM tier",
            path.display(),
            cred.pid,
            cred.uid,
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() }
        );
    }
    stream.set_read_timeout(Some(limit))?;
    let mut w = stream.try_clone()?;
    let mut line = serde_json::to_vec(&ask_of(cfg))?;
    line.push(b'\n');
    w.write_all(&line)?;
    let mut a = read_answer(&stream)?;
    let built = if a.live {
        let dram = build_live(&stream, &a, build)?;
        // The barrier: the donor stopped, drained, and sends the delta.
        a = read_answer(&stream)?;
        Some(dram)
    } else {
        None
    };
    let mut fds = std::collections::VecDeque::new();
    while fds.len() < 2 {
        let n = kvnode_fdpass_recv(&stream, &mut fds)?;
        if n == 0 {
            bail!("the running daemon closed the takeover socket while passing descriptors");
        }
    }
    let arena = std::fs::File::from(fds.pop_front().expect("two descriptors"));
    let listener = UnixListener::from(fds.pop_front().expect("two descriptors"));
    let bound = listener
        .local_addr()
        .context("reading the address of the handed-over listener")?;
    if bound.as_pathname() != Some(cfg.socket.as_path()) {
        bail!(
            "the listener handed over is bound to {:?}, not to --socket {}: refusing it",
            bound.as_pathname(),
            cfg.socket.display()
        );
    }
    let mut image = vec![0u8; usize::try_from(a.image_len)?];
    (&stream)
        .read_exact(&mut image)
        .context("reading the DRAM image")?;
    Ok(Some(Received {
        handover: Handover {
            arena,
            image,
            events_seq: None,
            nvme_announced: Vec::new(),
            dram: built,
        },
        listener,
        donor: a.pid,
        blocks: a.blocks,
        stream,
    }))
}

/// The donor's answer line (read byte by byte, so no descriptor-carrying byte is consumed
/// early); an error when it refused.
fn read_answer(stream: &UnixStream) -> anyhow::Result<Answer> {
    let mut ans = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = (&*stream)
            .read(&mut b)
            .context("waiting for the running daemon's answer")?;
        if n == 0 {
            bail!("the running daemon closed the takeover socket without an answer");
        }
        if b[0] == b'\n' {
            break;
        }
        ans.push(b[0]);
        if ans.len() > 1 << 16 {
            bail!("takeover answer too long");
        }
    }
    let a: Answer = serde_json::from_slice(&ans).context("parsing the takeover answer")?;
    if !a.ok {
        bail!(
            "the running daemon (pid {}) refused the takeover and keeps serving: {}",
            a.pid,
            a.error.unwrap_or_default()
        );
    }
    Ok(a)
}

/// Reads the live image and builds the tier from it (the donor serves meanwhile), then
/// tells the donor it may stop. A tier that cannot be built is refused: the donor keeps
/// serving and this process gives up.
fn build_live(
    stream: &UnixStream,
    a: &Answer,
    build: &dyn Fn(&[u8]) -> Result<DramTier, String>,
) -> anyhow::Result<DramTier> {
    let t = std::time::Instant::now();
    let mut image = vec![0u8; usize::try_from(a.image_len)?];
    (&*stream)
        .read_exact(&mut image)
        .context("reading the live DRAM image")?;
    match build(&image) {
        Ok(dram) => {
            build_pause();
            tracing::info!(
                blocks = a.blocks,
                image_bytes = image.len(),
                elapsed_ms = t.elapsed().as_millis() as u64,
                "built the DRAM tier from the live image while the running daemon serves"
            );
            drop(image);
            if a.pre_copy {
                pre_copy(stream, &dram)?;
            }
            (&*stream).write_all(b"built\n")?;
            Ok(dram)
        }
        Err(why) => {
            let _ =
                (&*stream).write_all(format!("failed: {}\n", why.replace('\n', " ")).as_bytes());
            bail!("the running daemon's live DRAM image cannot be used ({why}); it keeps serving")
        }
    }
}

/// Pre-copy rounds ([`kvnode_engine::dram::PRE_COPY`]) while the donor serves: each brings
/// the slots changed since the one before, applied to `dram`, until one is small.
fn pre_copy(stream: &UnixStream, dram: &DramTier) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    let report = kvnode_engine::dram::PRE_COPY.run(|| -> anyhow::Result<u64> {
        (&*stream).write_all(b"round\n")?;
        let a = read_answer(stream)?;
        let mut delta = vec![0u8; usize::try_from(a.image_len)?];
        (&*stream)
            .read_exact(&mut delta)
            .context("reading a pre-copy round")?;
        let slots = dram
            .apply_round(&delta)
            .map_err(|e| anyhow::anyhow!("applying a pre-copy round: {e}"))?;
        Ok(slots)
    })?;
    tracing::info!(
        rounds = report.rounds.len(),
        slots = ?report.rounds,
        elapsed_ms = t.elapsed().as_millis() as u64,
        "pre-copy rounds applied while the running daemon serves"
    );
    Ok(())
}

/// Test seam (a build with `test-seams` only): how long a successor holds its live build
/// open, so that a test can change the donor's tier meanwhile.
pub const BUILD_PAUSE_ENV: &str = "KVNODE_TEST_TAKEOVER_BUILD_PAUSE_MS";

fn build_pause() {
    if !kvnode_engine::TEST_SEAMS {
        return;
    }
    if let Some(ms) = std::env::var(BUILD_PAUSE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!(ms, "test seam: holding the live build open");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

fn kvnode_fdpass_recv(
    s: &UnixStream,
    fds: &mut std::collections::VecDeque<OwnedFd>,
) -> anyhow::Result<usize> {
    let mut one = [0u8; 1];
    kvnode_fdpass::recv_with_fds(s.as_raw_fd(), &mut one, fds, 2)
        .context("receiving the arena and listener descriptors")
}

// ----- donor -----

/// A successor whose request this daemon accepted: it waits for the hand-over.
#[derive(Debug)]
pub struct Pending {
    stream: UnixStream,
    pid: u32,
    continues_events: bool,
    /// The successor built its tier from a live image: send it the delta.
    live: bool,
    /// The successor asks for pre-copy rounds after its build.
    pre_copy: bool,
}

/// Binds the takeover socket (owner-only; its directory was made ready by
/// [`crate::takeover_dir::prepare`]) and accepts successors on a thread: a request
/// that does not fit this configuration is answered at once with the reason (this daemon
/// keeps serving); the first that fits is sent on `tx`, and the thread ends.
pub fn listen(
    cfg: &EngineConfig,
    dram: Weak<DramTier>,
    tx: tokio::sync::mpsc::Sender<Pending>,
) -> anyhow::Result<PathBuf> {
    let path = path_of(cfg)?;
    if let Ok(m) = std::fs::symlink_metadata(&path) {
        if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) {
            bail!(
                "{} exists and is not a socket: refusing to replace it",
                path.display()
            );
        }
        let _ = std::fs::remove_file(&path);
    }
    let l = UnixListener::bind(&path)
        .with_context(|| format!("binding the takeover socket {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let cfg = Arc::new(cfg.clone());
    std::thread::Builder::new()
        .name("kvnode-takeover".into())
        .spawn(move || accept_successors(&l, &cfg, &dram, &tx))?;
    Ok(path)
}

/// Screens each connection on its own thread (at most [`MAX_SCREENING`] at once; a silent
/// one holds only its own thread, for at most [`SCREEN_TIMEOUT`]); the first request that
/// fits is sent on `tx`, and no later one is.
fn accept_successors(
    l: &UnixListener,
    cfg: &Arc<EngineConfig>,
    dram: &Weak<DramTier>,
    tx: &tokio::sync::mpsc::Sender<Pending>,
) {
    let screening = Arc::new(AtomicUsize::new(0));
    let taken = Arc::new(AtomicBool::new(false));
    for s in l.incoming() {
        if taken.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = s else { continue };
        if screening.fetch_add(1, Ordering::AcqRel) >= MAX_SCREENING {
            screening.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("takeover request dropped: {MAX_SCREENING} are being screened already");
            continue;
        }
        let (cfg, tx, dram) = (Arc::clone(cfg), tx.clone(), dram.clone());
        let (screening, taken) = (Arc::clone(&screening), Arc::clone(&taken));
        let spawned = std::thread::Builder::new()
            .name("kvnode-takeover-screen".into())
            .spawn(move || {
                match screen(s, &cfg) {
                    Ok(Some(p)) => {
                        if taken.swap(true, Ordering::AcqRel) {
                            p.fail("another successor is taking this daemon over");
                        } else {
                            match p.go_live(&dram, takeover_limit(&cfg)) {
                                Ok(p) => {
                                    if let Err(e) = tx.blocking_send(p) {
                                        stop_tracking(&dram);
                                        e.0.fail("this daemon is stopping");
                                    }
                                }
                                Err(e) => {
                                    tracing::warn!(error = %format!("{e:#}"), "live takeover abandoned; still serving");
                                    taken.store(false, Ordering::Release);
                                }
                            }
                        }
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "takeover request dropped"),
                }
                screening.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "takeover request dropped: cannot start a thread");
        }
    }
}

/// Takeover connections screened at once.
const MAX_SCREENING: usize = 64;
/// How long a takeover connection may take to send its request.
const SCREEN_TIMEOUT: Duration = Duration::from_secs(2);

/// Reads one request; answers a refusal itself.
fn screen(s: UnixStream, cfg: &EngineConfig) -> anyhow::Result<Option<Pending>> {
    let cred = kvnode_fdpass::peer_cred(s.as_raw_fd())?;
    if !same_uid(cred.uid) {
        // Dropped unanswered: nothing is read from it, nothing is sent to it.
        bail!(
            "uid {} (pid {}) may not take this daemon over: only its own uid may",
            cred.uid,
            cred.pid
        );
    }
    s.set_read_timeout(Some(SCREEN_TIMEOUT))?;
    let mut r = BufReader::new(s.try_clone()?);
    let ask: Ask = serde_json::from_str(&read_line(&mut r, "takeover request")?)
        .context("parsing the takeover request")?;
    if let Some(why) = incompatible(&ask, cfg) {
        tracing::warn!(successor = ask.pid, reason = %why, "takeover refused; still serving");
        answer(&s, false, Some(why), 0, 0)?;
        return Ok(None);
    }
    tracing::info!(successor = ask.pid, version = %ask.version, "takeover accepted: handing the DRAM tier over");
    Ok(Some(Pending {
        stream: s,
        pid: ask.pid,
        continues_events: ask.continues_events,
        live: ask.live,
        pre_copy: ask.pre_copy,
    }))
}

/// How long either side of a takeover waits for the other (a drain, a build, an exit).
pub fn takeover_limit(cfg: &EngineConfig) -> Duration {
    Duration::from_secs_f64(cfg.drain_timeout_s + 60.0)
}

fn stop_tracking(dram: &Weak<DramTier>) {
    if let Some(d) = dram.upgrade() {
        d.stop_tracking();
    }
}

fn answer(
    s: &UnixStream,
    ok: bool,
    error: Option<String>,
    image_len: u64,
    blocks: u64,
) -> anyhow::Result<()> {
    answer_as(s, ok, error, (image_len, blocks), (false, false))?;
    Ok(())
}

/// The answer line; `live`: the image that follows is a live one; `pre_copy`: this daemon
/// answers pre-copy rounds after it.
fn answer_as(
    mut s: &UnixStream,
    ok: bool,
    error: Option<String>,
    (image_len, blocks): (u64, u64),
    (live, pre_copy): (bool, bool),
) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(&Answer {
        ok,
        error,
        pid: std::process::id(),
        image_len,
        blocks,
        live,
        pre_copy,
    })?;
    line.push(b'\n');
    s.write_all(&line)?;
    Ok(())
}

impl Pending {
    /// The successor's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the successor built its tier from a live image (it gets the delta).
    pub fn live(&self) -> bool {
        self.live
    }

    /// A successor that builds from a live image gets it now, while this daemon serves;
    /// returns once it has built its tier (then the barrier: stop, drain, send the delta).
    /// An error: it went away or could not build; tracking stopped, this daemon serves on.
    fn go_live(self, dram: &Weak<DramTier>, limit: Duration) -> anyhow::Result<Self> {
        if !self.live {
            return Ok(self);
        }
        let Some(d) = dram.upgrade() else {
            self.fail("this daemon is stopping");
            bail!("this daemon is stopping");
        };
        let (image, st) = match d.live_image() {
            Ok(x) => x,
            Err(e) => {
                d.stop_tracking();
                self.fail(&e.to_string());
                return Err(e.into());
            }
        };
        tracing::info!(
            successor = self.pid,
            blocks = st.blocks,
            image_bytes = image.len(),
            max_lock_hold_us = st.max_hold.as_micros() as u64,
            elapsed_ms = st.elapsed.as_millis() as u64,
            "takeover: live image taken; serving while the successor builds"
        );
        let built = (|| {
            answer_as(
                &self.stream,
                true,
                None,
                (image.len() as u64, st.blocks),
                (true, self.pre_copy),
            )?;
            (&self.stream).write_all(&image)?;
            drop(image);
            self.stream.set_read_timeout(Some(limit))?;
            let mut r = BufReader::new(self.stream.try_clone()?);
            loop {
                let l = read_line(&mut r, "successor's build")?;
                if !self.pre_copy || l.trim() != "round" {
                    return Ok(l);
                }
                self.send_round(&d)?;
            }
        })();
        match built {
            Ok(l) if l.trim() == "built" => Ok(self),
            Ok(l) => {
                d.stop_tracking();
                bail!("the successor could not build its tier: {}", l.trim())
            }
            Err(e) => {
                d.stop_tracking();
                Err(e)
            }
        }
    }

    /// One pre-copy round, while serving: the slots changed since the image or the last
    /// round, as a delta.
    fn send_round(&self, d: &DramTier) -> anyhow::Result<()> {
        let t = std::time::Instant::now();
        let (delta, slots) = d.delta_round()?;
        let taken_us = t.elapsed().as_micros() as u64;
        answer_as(
            &self.stream,
            true,
            None,
            (delta.len() as u64, slots),
            (false, true),
        )?;
        (&self.stream).write_all(&delta)?;
        tracing::info!(
            successor = self.pid,
            slots,
            delta_bytes = delta.len(),
            taken_us,
            "takeover: pre-copy round sent; serving"
        );
        Ok(())
    }

    /// Tells the successor this daemon cannot hand over after all (it stops normally).
    pub fn fail(self, why: &str) {
        let _ = answer(&self.stream, false, Some(why.into()), 0, 0);
    }

    /// Sends the arena, the listener and the image; waits (at most `limit`) for the
    /// successor's verdict. `Ok(Accepted)`: it took the tier (keep the stream open until
    /// this process is done with the spill files, then drop it).
    pub fn send(
        self,
        h: &Handover,
        listener: &impl AsFd,
        blocks: u64,
        limit: Duration,
    ) -> Result<Accepted, SendError> {
        let s = self.stream;
        let sent = (|| {
            answer(&s, true, None, h.image.len() as u64, blocks)?;
            for fd in [h.arena.as_fd(), listener.as_fd()] {
                let n = kvnode_fdpass::send_with_fd(s.as_raw_fd(), b"F", fd)?;
                if n != 1 {
                    bail!("short write passing a descriptor");
                }
            }
            (&s).write_all(&h.image)?;
            s.set_read_timeout(Some(limit))?;
            let mut r = BufReader::new(s.try_clone()?);
            read_line(&mut r, "successor's verdict")
        })();
        let verdict = sent.map_err(SendError::Gone)?;
        match verdict.trim() {
            "ok" => Ok(Accepted {
                stream: s,
                continues_events: self.continues_events,
            }),
            v => Err(SendError::Refused(v.to_owned())),
        }
    }
}

/// Why a hand-over did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The successor looked and cannot use the tier: it starts cold in this daemon's
    /// place, so this one must flush and exit.
    #[error("the successor could not use the DRAM tier: {0}")]
    Refused(String),
    /// The successor vanished (closed, died, timed out) before its verdict: nobody takes
    /// this daemon's place, so it resumes serving.
    #[error("the successor went away during the hand-over: {0:#}")]
    Gone(anyhow::Error),
}

/// The successor holds the tier; dropping this tells it this daemon is gone.
#[derive(Debug)]
pub struct Accepted {
    stream: UnixStream,
    continues_events: bool,
}

/// The line that tells the successor where it continues the KV event stream.
const EVENTS_SEQ: &str = "events-seq ";
/// The line that announces the NVMe announcements' bytes (`dram::image::encode_announced`).
const NVME_ANNOUNCED: &str = "nvme-announced ";

impl Accepted {
    /// Whether the successor continues this daemon's KV event stream (this build or later).
    pub fn continues_events(&self) -> bool {
        self.continues_events
    }

    /// Tells the successor to continue the KV event stream at `seq` (its first batch) and
    /// which blocks are announced on NVMe, so that it adopts the DRAM and NVMe tiers'
    /// blocks instead of announcing them again. A successor that hears nothing (events off
    /// here) starts a new stream.
    pub fn continue_events(&self, h: &kvnode_engine::residency::HandedOver) {
        let nvme = kvnode_engine::dram::image::encode_announced(&h.nvme);
        let head = format!("{EVENTS_SEQ}{}\n{NVME_ANNOUNCED}{}\n", h.seq, nvme.len());
        let sent = (&self.stream)
            .write_all(head.as_bytes())
            .and_then(|()| (&self.stream).write_all(&nvme));
        if let Err(e) = sent {
            tracing::warn!(error = %e, "could not tell the successor the KV event seq");
        }
    }
}

/// The seq and NVMe announcements a donor's last words give (`continue_events`), if any;
/// none when they are absent or malformed (the successor then starts a new stream).
fn continuation_of(
    rest: &[u8],
) -> Option<(
    u64,
    Vec<(kvnode_proto::BlockKey, kvnode_engine::residency::RouterMeta)>,
)> {
    let line = |b: &[u8], prefix: &str| -> Option<(u64, usize)> {
        let end = b.iter().position(|&c| c == b'\n')?;
        let text = std::str::from_utf8(&b[..end]).ok()?;
        Some((text.strip_prefix(prefix)?.trim().parse().ok()?, end + 1))
    };
    let (seq, a) = line(rest, EVENTS_SEQ)?;
    let (len, b) = line(&rest[a..], NVME_ANNOUNCED)?;
    let body = rest.get(a + b..a + b + usize::try_from(len).ok()?)?;
    match kvnode_engine::dram::image::decode_announced(body) {
        Ok(list) => Some((seq, list)),
        Err(e) => {
            tracing::warn!(error = %e, "the previous daemon's NVMe announcements are malformed: starting a new event stream");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_continuation_is_read_from_the_donors_last_words_or_is_absent() {
        let empty = kvnode_engine::dram::image::encode_announced(&[]);
        let mut words = format!("events-seq 12345\nnvme-announced {}\n", empty.len()).into_bytes();
        words.extend_from_slice(&empty);
        assert_eq!(continuation_of(&words).map(|c| c.0), Some(12345));
        assert!(continuation_of(b"").is_none());
        assert!(continuation_of(b"events-seq x\nnvme-announced 8\n\0\0\0\0\0\0\0\0").is_none());
        assert!(
            continuation_of(&words[..words.len() - 1]).is_none(),
            "truncated"
        );
        let mut lying = format!("events-seq 1\nnvme-announced {}\n", empty.len()).into_bytes();
        lying.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(
            continuation_of(&lying).is_none(),
            "a count the bytes cannot hold"
        );
    }

    #[test]
    fn a_different_dram_layout_is_refused_with_the_difference_named() {
        let cfg = EngineConfig {
            dram: 64 << 20,
            ..EngineConfig::default()
        };
        let mut ask = ask_of(&cfg);
        assert_eq!(incompatible(&ask, &cfg), None);
        ask.dram = 128 << 20;
        let why = incompatible(&ask, &cfg).unwrap();
        assert!(why.contains("dram 67108864 -> 134217728"), "{why}");
        ask.dram = cfg.dram;
        ask.image_formats = vec!["KVNDRAM9".into()];
        assert!(incompatible(&ask, &cfg).unwrap().contains("KVNDRAM9"));
    }

    #[test]
    fn only_this_daemons_own_uid_passes_the_uid_check() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert!(same_uid(me));
        assert!(!same_uid(me.wrapping_add(1)));
        // Root passes only where this daemon is root itself.
        assert_eq!(same_uid(0), me == 0);
    }
}
