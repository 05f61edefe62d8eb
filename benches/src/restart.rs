//! `kvnode bench restart`: how soon a restarted daemon answers its first hit, and what it kept.
//!
//! Starts `kvnode serve` in `--dir`, puts `--blocks` blocks of `--block-bytes`, then restarts
//! it one of three ways and times, from the spawn of the new process, the first `get` that
//! returns a kept block with the right bytes:
//!
//! - `takeover`: `kvnode serve --takeover` next to the running daemon (DRAM tier handed
//!   over: arena memfd + index; no spill tier unless `--spill`).
//! - `sigkill`: SIGKILL, then a plain start on the same spill directory (blocks recovered
//!   from the spill files; a small DRAM tier makes most blocks NVMe-only).
//! - `sigterm`: SIGTERM (the stop-time flush writes DRAM-only blocks down), then a start.
//!
//! With `--load-clients N`, N clients keep issuing gets and puts across the restart and the
//! service gap they see is reported (`restart_load`); after a signal, gets of blocks only on
//! NVMe that miss while the new daemon's spill index is rebuilt are counted, not failed.
//!
//! The same-run floor is the time to spawn the same binary and have it exit
//! (`kvnode serve --print-config`): no restart can answer sooner. The new daemon's log gives
//! the breakdown (takeover, spill recovery, fixed-buffer registration).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use kvnode_client::Client;
use kvnode_proto::Key;
use kvnode_proto::client::BlockMeta;
use kvnode_proto::size::{ByteSize, parse_size};

use crate::restart_load::{fill, key, spec};
use crate::restart_probe::{Filled, rss_anon};

/// How the daemon is restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// `serve --takeover` while the old daemon runs.
    Takeover,
    /// SIGKILL, then start on the same spill directory.
    Sigkill,
    /// SIGTERM (stop-time flush), then start.
    Sigterm,
}

/// `kvnode bench restart` flags.
#[derive(Debug, Args)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent on/off flags of the CLI"
)]
pub struct RestartArgs {
    /// Working directory (socket, spill file, daemon logs); on the device to measure.
    #[arg(long, default_value = "/var/tmp/kvnode-bench-restart")]
    pub dir: PathBuf,
    /// How to restart.
    #[arg(long, value_enum, default_value = "sigkill")]
    pub mode: Mode,
    /// Blocks put before the restart.
    #[arg(long, default_value_t = 100_000)]
    pub blocks: u64,
    /// Bytes per block.
    #[arg(long, default_value = "16KiB")]
    pub block_bytes: String,
    /// DRAM tier.
    #[arg(long, default_value = "256MiB")]
    pub dram: String,
    /// Give the daemon a spill directory (always on for sigkill and sigterm).
    #[arg(long)]
    pub spill: bool,
    /// Daemon binary to restart (default: this one), e.g. an older build for a before/after
    /// comparison (`takeover` needs a build that has it).
    #[arg(long)]
    pub daemon: Option<PathBuf>,
    /// mlock the arena (the daemon's default; off here unless asked, to leave the machine's
    /// memory to others).
    #[arg(long)]
    pub pin: bool,
    /// Do not fault the arena in ahead of use (a large tier then takes only the memory its
    /// blocks use).
    #[arg(long)]
    pub no_populate: bool,
    /// Clients that keep issuing requests (gets of kept blocks, a put every 16th) across the
    /// restart, each on its own connection; the service gap they see is reported.
    #[arg(long, default_value_t = 0)]
    pub load_clients: u64,
    /// After the fill, time this many single-key requests of each of exists, get and put
    /// (the puts add as many new blocks: leave room in `--dram`); 0: none.
    #[arg(long, default_value_t = 0)]
    pub probes: u64,
    /// Back the arena with 2 MiB huge pages (`hugetlb = true`: needs `vm.nr_hugepages`).
    #[arg(long)]
    pub hugetlb: bool,
    /// The daemon's `[spill] flush_on_stop_s` (default: the daemon's, 60 s).
    #[arg(long)]
    pub flush_on_stop_s: Option<f64>,
    /// Publish KV events (an ipc endpoint in `--dir`, no subscriber needed) and put every
    /// block with router metadata, so a takeover hands the event stream over.
    #[arg(long)]
    pub events: bool,
}

fn spawn(
    bin: &Path,
    cfg: &Path,
    sock: &Path,
    log: &Path,
    extra: &[&str],
) -> anyhow::Result<std::process::Child> {
    let log = std::fs::File::create(log)?;
    Ok(Command::new(bin)
        .arg("serve")
        .arg("--config")
        .arg(cfg)
        .arg("--socket")
        .arg(sock)
        .args(extra)
        .env("KVNODE_LOG", "info,kvnode_engine::nvme=debug")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?)
}

/// Polls until the daemon with `pid` returns block `i` with its bytes; the time from `t0`.
/// A miss while the daemon's spill index is being rebuilt is polled again.
fn first_hit(sock: &Path, pid: u32, bs: u64, i: u64, t0: Instant) -> anyhow::Result<Duration> {
    let mut want = vec![0x5Au8; bs as usize];
    fill(&mut want, i);
    while t0.elapsed() < Duration::from_mins(2) {
        if let Ok(mut c) = Client::connect(sock)
            && c.stats().is_ok_and(|s| s.pid == pid)
        {
            let ns = c.register(&spec(bs))?.ns;
            loop {
                let recovering = c.stats()?.spill_recovering;
                let got = c.get(ns, &[key(i)])?;
                match &got[0] {
                    Some(b) if *b == want => return Ok(t0.elapsed()),
                    Some(_) => bail!("block {i} came back with other bytes"),
                    None if recovering && t0.elapsed() < Duration::from_mins(2) => {
                        std::thread::sleep(Duration::from_micros(500));
                    }
                    None => bail!("block {i} was not kept across the restart"),
                }
            }
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    bail!("the new daemon never answered")
}

fn wait_exit(
    c: &mut std::process::Child,
    limit: Duration,
) -> anyhow::Result<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(s) = c.try_wait()? {
            return Ok(s);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    bail!("daemon did not exit within {limit:?}")
}

/// `name=value` fields of the log line containing `msg` (tracing's plain format).
fn log_field(log: &str, msg: &str, field: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(msg))?;
    let at = line.find(&format!(" {field}="))?;
    let rest = &line[at + field.len() + 2..];
    Some(rest.split_whitespace().next()?.to_owned())
}

/// The daemon's configuration file.
fn config_text(a: &RestartArgs, bs: u64, dram: u64, spill: bool) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let slab = (bs.next_power_of_two()).max(2 << 20);
    let mut text = format!(
        "dram = \"{}\"\nslab_size = {slab}\npin = {}\npopulate = {}\nhugetlb = {}\n",
        ByteSize(dram),
        a.pin,
        !a.no_populate,
        a.hugetlb
    );
    if a.events {
        writeln!(
            text,
            "[events]\nendpoint = \"ipc://{}\"",
            a.dir.join("events.sock").display()
        )?;
    }
    if spill {
        let dir = a.dir.join("spill");
        std::fs::create_dir_all(&dir)?;
        let size = (a.blocks * bs.div_ceil(4096) * 4096 + 8192 * a.blocks) * 5 / 4 + (256 << 20);
        write!(
            text,
            "[spill]\ndirs = [{{ path = \"{}\", size = {size} }}]\n",
            dir.display()
        )?;
        if let Some(f) = a.flush_on_stop_s {
            writeln!(text, "flush_on_stop_s = {f}")?;
        }
    }
    Ok(text)
}

/// Puts blocks `0..n` (32 per request); returns the seconds until demotion drained.
/// With `events`, each block carries router metadata (its page's tokens), so it is
/// announced.
pub(crate) fn fill_blocks(c: &mut Client, bs: u64, n: u64, events: bool) -> anyhow::Result<f64> {
    let spec = spec(bs);
    let page = u64::from(spec.page_size);
    let ns = c.register(&spec)?.ns;
    let mut buf = vec![0x5Au8; bs as usize];
    let batch = 32u64;
    let t = Instant::now();
    for start in (0..n).step_by(batch as usize) {
        let end = (start + batch).min(n);
        let bufs: Vec<Vec<u8>> = (start..end)
            .map(|i| {
                fill(&mut buf, i);
                buf.clone()
            })
            .collect();
        let keys: Vec<Key> = (start..end).map(key).collect();
        let refs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        let meta = if events {
            (start..end)
                .map(|i| {
                    Some(BlockMeta {
                        tokens: (i * page..(i + 1) * page).map(|t| t as u32).collect(),
                        parent: None,
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        c.put_with_meta(ns, &keys, &refs, meta)?;
    }
    while c.stats()?.tiers[0].in_flight > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Waits (bounded) for the background fixed-buffer registration to be logged when there is a
/// spill tier, to report what it costs off the critical path; stops the new daemon; returns
/// its log.
fn stop_new(new: &mut std::process::Child, new_log: &Path, spill: bool) -> String {
    if spill {
        // The fixed-buffer registration runs in the background once the arena is populated:
        // wait (bounded) for its log line, to report what it costs off the critical path.
        let t = Instant::now();
        while t.elapsed() < Duration::from_mins(1)
            && !std::fs::read_to_string(new_log)
                .unwrap_or_default()
                .contains("arena registered with the spill rings")
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = new.kill();
    let _ = new.wait();
    std::fs::read_to_string(new_log).unwrap_or_default()
}

/// Starts the daemon to be restarted and connects to it.
fn start_old(
    bin: &Path,
    cfg: &Path,
    sock: &Path,
    log: &Path,
) -> anyhow::Result<(std::process::Child, Client)> {
    let old = spawn(bin, cfg, sock, log, &[])?;
    let t = Instant::now();
    loop {
        if let Ok(c) = Client::connect(sock) {
            return Ok((old, c));
        }
        if t.elapsed() > Duration::from_mins(1) {
            bail!("daemon did not start; see {}", log.display());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `kvnode serve --takeover` next to `old` (binary, config, socket, log of the new one), with
/// the load clients running if asked; the first hit of block `probe` and the new daemon.
fn take_over(
    a: &RestartArgs,
    (bin, cfg, sock, new_log): (&Path, &Path, &Path, &Path),
    old: &mut std::process::Child,
    (bs, probe): (u64, u64),
) -> anyhow::Result<(Duration, std::process::Child)> {
    // With a spill tier, blocks only on NVMe miss while the successor rebuilds its index.
    let load = (a.load_clients > 0).then(|| {
        if a.spill {
            crate::restart_load::Load::start_missing(sock, a.load_clients, bs, a.blocks)
        } else {
            crate::restart_load::Load::start(sock, a.load_clients, bs, a.blocks)
        }
    });
    // Let the clients run before the takeover starts.
    std::thread::sleep(Duration::from_millis(if load.is_some() { 500 } else { 0 }));
    let t0 = Instant::now();
    if load.is_some() {
        // The interval offsets below count from here: the daemons' log times place them.
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
        println!("successor spawned at unix {:.6} s", unix.as_secs_f64());
    }
    let mut new = spawn(bin, cfg, sock, new_log, &["--takeover"])?;
    // The probe asks `stats` (a walk over every slot, under the tier's lock): with load
    // clients it waits until the old daemon is gone, so as not to stall them (its figure is
    // then an upper bound).
    let f = if load.is_some() {
        let st = wait_exit(old, Duration::from_mins(2));
        let f = first_hit(sock, new.id(), bs, probe, t0);
        st?;
        f
    } else {
        first_hit(sock, new.id(), bs, probe, t0)
    };
    let st = wait_exit(old, Duration::from_mins(2))?;
    if !st.success() {
        let _ = new.kill();
        bail!("the old daemon exited with {st}");
    }
    if let Some(load) = load {
        std::thread::sleep(Duration::from_millis(500));
        crate::restart_load::report(
            &load.stop(t0, Instant::now())?,
            sock,
            bs,
            "the takeover",
            "the spawn",
        )?;
    }
    Ok((f?, new))
}

/// SIGKILL or SIGTERM, then a plain start on the same spill directory (with load clients
/// across both): the time to the first hit of block `probe`, the old daemon's stop, the new
/// daemon.
fn stop_and_start(
    a: &RestartArgs,
    (bin, cfg, sock, new_log): (&Path, &Path, &Path, &Path),
    old: &mut std::process::Child,
    (bs, probe): (u64, u64),
) -> anyhow::Result<(Duration, Duration, std::process::Child)> {
    // With load clients: they run across the stop and the start; blocks only on
    // NVMe miss while the new daemon's spill index is rebuilt (counted).
    let load = (a.load_clients > 0)
        .then(|| crate::restart_load::Load::start_missing(sock, a.load_clients, bs, a.blocks));
    std::thread::sleep(Duration::from_millis(if load.is_some() { 500 } else { 0 }));
    let t = Instant::now();
    if a.mode == Mode::Sigkill {
        old.kill()?;
    } else {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(libc::pid_t::try_from(old.id())?, libc::SIGTERM) };
    }
    wait_exit(old, Duration::from_mins(10))?;
    let stop = t.elapsed();
    let t0 = Instant::now();
    let new = spawn(bin, cfg, sock, new_log, &[])?;
    let first = first_hit(sock, new.id(), bs, probe, t0)?;
    if let Some(load) = load {
        std::thread::sleep(Duration::from_millis(500));
        crate::restart_load::report(
            &load.stop(t, Instant::now())?,
            sock,
            bs,
            "the stop and the start",
            "the signal",
        )?;
    }
    Ok((first, stop, new))
}

/// What each daemon had published (`--events`): a storm shows as the new one announcing
/// every block taken over again.
fn print_events(old: Option<u64>, new: Option<u64>) {
    let shown = |n: Option<u64>| n.map_or_else(|| "none (events off?)".into(), |n| n.to_string());
    println!(
        "KV events: the old daemon had published {} after the fill, the new one {} by its \
         first hit (a storm would announce every block taken over again)",
        shown(old),
        shown(new),
    );
}

/// Runs the benchmark.
pub fn run(a: &RestartArgs) -> anyhow::Result<()> {
    let bs = parse_size(&a.block_bytes).context("--block-bytes")?;
    let dram = parse_size(&a.dram).context("--dram")?;
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir)?;
    let bin = match &a.daemon {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let sock = a.dir.join("kvnode.sock");
    let cfg = a.dir.join("restart.toml");
    let spill = a.spill || a.mode != Mode::Takeover;
    std::fs::write(&cfg, config_text(a, bs, dram, spill)?)?;
    // The same-run floor: spawn the binary and have it exit.
    let t = Instant::now();
    let st = Command::new(&bin)
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .status()?;
    let floor = t.elapsed();
    if !st.success() {
        bail!("kvnode serve --print-config failed");
    }
    let (mut old, mut c) = start_old(&bin, &cfg, &sock, &a.dir.join("old.log"))?;
    let heap0 = rss_anon(old.id())?;
    let fill_s = fill_blocks(&mut c, bs, a.blocks, a.events)?;
    let filled = Filled::measure(&mut c, old.id(), heap0, bs, a.blocks, a.probes)?;
    let s = c.stats()?;
    let (in_dram, on_nvme) = (s.tiers[0].blocks, s.tiers.get(1).map_or(0, |t| t.blocks));
    let published_old = s.events.as_ref().map(|e| e.published);
    // The block to hit: the newest one for a takeover (in DRAM), the oldest otherwise
    // (moved to NVMe first).
    let probe = if a.mode == Mode::Takeover {
        a.blocks - 1
    } else {
        0
    };
    drop(c);
    let new_log = a.dir.join("new.log");
    let (first, stop_ms, mut new) = match a.mode {
        Mode::Takeover => {
            let new = take_over(a, (&bin, &cfg, &sock, &new_log), &mut old, (bs, probe))?;
            (new.0, None, new.1)
        }
        Mode::Sigkill | Mode::Sigterm => {
            let (first, stop, new) =
                stop_and_start(a, (&bin, &cfg, &sock, &new_log), &mut old, (bs, probe))?;
            (first, Some(stop), new)
        }
    };
    let mut c = Client::connect(&sock)?;
    // What was kept counts the NVMe tier too: once its index is rebuilt.
    let t = Instant::now();
    let s = loop {
        let s = c.stats()?;
        if !s.spill_recovering || t.elapsed() > Duration::from_mins(2) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let kept = s.tiers.iter().map(|t| t.blocks).sum::<u64>();
    let published_new = s.events.as_ref().map(|e| e.published);
    let heap_new = rss_anon(new.id())?;
    drop(c);
    let log = stop_new(&mut new, &new_log, spill);
    println!(
        "bench restart: daemon {} mode {:?} blocks {} x {} dram {} pin {} populate {} dir {}",
        bin.display(),
        a.mode,
        a.blocks,
        ByteSize(bs),
        ByteSize(dram),
        a.pin,
        !a.no_populate,
        a.dir.display()
    );
    println!("before: {in_dram} blocks in DRAM, {on_nvme} on NVMe (filled in {fill_s:.1} s)");
    if a.events {
        print_events(published_old, published_new);
    }
    filled.print(a.blocks);
    if let Some(s) = stop_ms {
        println!("old daemon stopped in {:.0} ms", s.as_secs_f64() * 1e3);
    }
    println!(
        "the new daemon's RssAnon: {heap_new} bytes, {:.1} per kept block",
        heap_new as f64 / kept.max(1) as f64
    );
    println!(
        "first hit {:.0} ms after the new process was spawned; same-run floor (spawn + exit of the binary) {:.0} ms; {kept} blocks kept",
        first.as_secs_f64() * 1e3,
        floor.as_secs_f64() * 1e3
    );
    let field = |msg, f| log_field(&log, msg, f).unwrap_or_else(|| "-".into());
    println!(
        "new daemon's log: takeover {} ms, spill recovery {} ms ({} blocks), fixed-buffer registration {} ms (background)",
        field("took over the DRAM tier", "elapsed_ms"),
        field("spill tier recovered", "elapsed_ms"),
        field("spill tier recovered", "blocks"),
        field("arena registered with the spill rings", "elapsed_ms"),
    );
    let _ = std::fs::remove_dir_all(a.dir.join("spill"));
    Ok(())
}
