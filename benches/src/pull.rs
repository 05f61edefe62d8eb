//! `kvnode bench pull`: two daemons on loopback, peer pull throughput and latency, with
//! `iperf3 -c 127.0.0.1 -l 1M` (one stream, and `-P N` for N connections) and a memcpy of
//! the same bytes measured in the same run; CPU seconds per GB of both daemons against
//! iperf3's (client + server) in the same round.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use hdrhistogram::Histogram;
use kvnode_client::Client;
use kvnode_proto::pull::OpState;
use kvnode_proto::size::{ByteSize, parse_size};
use kvnode_proto::{Digest, Key, NamespaceSpec};

mod moved;
mod report;

use moved::{Counters, Moved};
use report::{Results, Round};

#[derive(Debug, Args)]
pub struct PullArgs {
    /// Page size of the throughput run.
    #[arg(long, default_value = "1MiB")]
    pub page_size: String,
    /// Pages per throughput pull.
    #[arg(long, default_value_t = 64)]
    pub pages: usize,
    /// Throughput pulls per round.
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,
    /// Rounds of (iperf3, then the throughput pulls): each round's pull median is compared
    /// with its own iperf3 run, so a machine whose speed drifts compares like with like.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Page size of the latency run.
    #[arg(long, default_value = "64KiB")]
    pub latency_page: String,
    /// Single-page pulls timed for the latency percentiles.
    #[arg(long, default_value_t = 1000)]
    pub latency_samples: usize,
    /// Connections per peer.
    #[arg(long, default_value_t = 2)]
    pub connections: u32,
    /// Peer transport of both daemons (`--peer-transport`): tcp, ucx or auto. With ucx the
    /// daemons inherit `UCX_*` from this process (e.g. `UCX_TLS=tcp` or `UCX_TLS=sm`), and the
    /// run fails unless the destination's counters show every block of the measured pulls
    /// read by a UCX GET and no fallback to TCP.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "ucx", "auto"])]
    pub transport: String,
    /// Pass `--peer-ucx-insecure-software-rma` to both daemons: let UCX run over its software
    /// RMA (TCP, shared memory), as on a machine without an RDMA device. Both daemons are on
    /// loopback here; a production daemon refuses software RMA without the switch.
    #[arg(long)]
    pub ucx_software_rma: bool,
    /// Seconds of each iperf3 run (0 skips it).
    #[arg(long, default_value_t = 3)]
    pub iperf_seconds: u32,
    /// Print a JSON summary line as well.
    #[arg(long)]
    pub json: bool,
    /// Extra `kvnode serve` argument for both daemons (repeat it), e.g. `--daemon-arg=--hugetlb`.
    #[arg(long = "daemon-arg", allow_hyphen_values = true)]
    pub daemon_args: Vec<String>,
}

struct Proc(Child, PathBuf);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn daemon(tag: &str, args: &[String]) -> anyhow::Result<(Proc, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("kvnode-bench-pull-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("kvnode.sock");
    let child = Command::new(std::env::current_exe()?)
        .args(["serve", "--dram", "512MiB", "--no-pin", "--socket"])
        .arg(&sock)
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log"))?)
        .spawn()
        .context("starting a daemon")?;
    let p = Proc(child, dir);
    let t = Instant::now();
    while Client::connect(&sock).is_err() {
        if t.elapsed() > Duration::from_secs(10) {
            bail!(
                "daemon {tag} did not start; see {}",
                p.1.join("log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok((p, sock))
}

/// Waits until a daemon has faulted its arena in (its start-up prefault competes for the
/// CPU with whatever is measured next), or until it stops populating (`--no-populate`).
fn settle(c: &mut Client) -> anyhow::Result<()> {
    let populated = |c: &mut Client| -> anyhow::Result<(u64, u64)> {
        let t = c
            .stats()?
            .tiers
            .into_iter()
            .next()
            .context("no DRAM tier")?;
        Ok((t.populated_bytes, t.capacity_bytes))
    };
    let (mut last, t) = (u64::MAX, Instant::now());
    loop {
        let (now, cap) = populated(c)?;
        if now >= cap || now == last || t.elapsed() > Duration::from_mins(1) {
            return Ok(());
        }
        last = now;
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn spec(page: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: format!("bench-pull-{}", ByteSize(page)),
        page_size: 64,
        segments: vec![page],
        ..NamespaceSpec::default()
    }
}

fn key(tag: u64, i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&(tag << 32 | i).to_be_bytes());
    d[8] = 0xb7;
    Key::page(Digest(d))
}

fn hint(port: u16, keys: &[Key]) -> String {
    let hashes: Vec<u64> = keys.iter().map(|k| k.0.router_hash()).collect();
    serde_json::json!({"source_control_endpoint": format!("tcp://127.0.0.1:{port}"), "block_hashes": hashes}).to_string()
}

/// Pulls `keys` with a hint through a lease get; returns the seconds taken.
fn pull(c: &mut Client, ns: u32, keys: &[Key], hint: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (lease, op) = c.get_lease_hinted(ns, keys, Some(hint), Some(30_000))?;
    let secs = t.elapsed().as_secs_f64();
    let op = op.context("no pull report")?;
    if op.state != OpState::Done || lease.leading_hits() != keys.len() {
        bail!("pull incomplete: {op:?}");
    }
    c.release(lease.id)?;
    c.delete(ns, keys)?;
    Ok(secs)
}

/// CPU seconds (user + system, every thread) `pid` has used so far.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    f.iter().sum::<f64>() / hz.max(1.0)
}

/// One iperf3 run: bytes per second, and CPU seconds per GB of client and server together.
struct Iperf {
    bps: f64,
    cpu_per_gb: f64,
}

fn iperf3(secs: u32, streams: u32) -> anyhow::Result<Iperf> {
    let port = free_port()?;
    let server = Command::new("iperf3")
        .args(["-s", "-1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s (apt-get install iperf3)")?;
    let _server = Proc(server, PathBuf::from("/nonexistent-kvnode-bench"));
    let t = Instant::now();
    loop {
        let out = Command::new("iperf3")
            .args([
                "-c",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-l",
                "1M",
                "-J",
                "-P",
                &streams.to_string(),
                "-t",
            ])
            .arg(secs.to_string())
            .output()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            let cpu = &v["end"]["cpu_utilization_percent"];
            let pct = cpu["host_total"].as_f64().unwrap_or(0.0)
                + cpu["remote_total"].as_f64().unwrap_or(0.0);
            let bps = bps / 8.0;
            return Ok(Iperf {
                bps,
                cpu_per_gb: pct / 100.0 / (bps / 1e9),
            });
        }
        if t.elapsed() > Duration::from_secs(5) {
            bail!("iperf3 failed: {}", String::from_utf8_lossy(&out.stdout));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `UCX_*` settings the daemons inherit, for the report.
fn ucx_env() -> String {
    let mut v: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("UCX_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    v.sort();
    if v.is_empty() {
        String::new()
    } else {
        format!(" ({})", v.join(" "))
    }
}

/// The bytes of every block [`put_all`] stores.
fn page_bytes(page: u64) -> Vec<u8> {
    (0..page).map(|i| (i * 31 % 251) as u8).collect()
}

fn put_all(c: &mut Client, ns: u32, keys: &[Key], page: u64) -> anyhow::Result<()> {
    let buf = page_bytes(page);
    for part in keys.chunks(32) {
        let blocks: Vec<&[u8]> = part.iter().map(|_| buf.as_slice()).collect();
        c.put(ns, part, &blocks)?;
    }
    Ok(())
}

/// Microseconds of `samples` single-page pulls of `keys` (one at a time, in turn).
fn latency(
    d: &mut Client,
    ns: u32,
    keys: &[Key],
    port: u16,
    samples: usize,
) -> anyhow::Result<Histogram<u64>> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for i in 0..samples {
        let k = &keys[i % keys.len()..=i % keys.len()];
        h.saturating_record((pull(d, ns, k, &hint(port, k))? * 1e6) as u64);
    }
    Ok(h)
}

/// The source and destination daemons; the source listens for peers on `port`.
struct Daemons {
    port: u16,
    src: Proc,
    dst: Proc,
    src_sock: PathBuf,
    dst_sock: PathBuf,
}

fn start(a: &PullArgs) -> anyhow::Result<Daemons> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut src_args = vec![
        "--peer-listen".into(),
        listen.clone(),
        "--advertise".into(),
        format!("tcp://{listen}"),
        "--peer-transport".into(),
        a.transport.clone(),
    ];
    let software = a
        .ucx_software_rma
        .then(|| "--peer-ucx-insecure-software-rma".to_owned());
    src_args.extend(software.clone());
    if !a.daemon_args.iter().any(|x| x.starts_with("--cluster-key")) {
        // A keyless listener serves every local user: the daemon wants that said.
        src_args.push("--peer-keyless-serves-every-local-user".into());
    }
    src_args.extend(a.daemon_args.iter().cloned());
    let (src, src_sock) = daemon("src", &src_args)?;
    let mut dst_args = vec![
        "--peers".into(),
        format!("tcp://{listen}"),
        "--peer-connections".into(),
        a.connections.to_string(),
        "--peer-transport".into(),
        a.transport.clone(),
    ];
    dst_args.extend(software);
    dst_args.extend(a.daemon_args.iter().cloned());
    let (dst, dst_sock) = daemon("dst", &dst_args)?;
    Ok(Daemons {
        port,
        src,
        dst,
        src_sock,
        dst_sock,
    })
}

/// One round: iperf3 (one stream, and `-P N`), the cold plain socket and memcpy, then the
/// pulls, with both daemons' CPU time over the pulls.
fn round(
    a: &PullArgs,
    dm: &Daemons,
    d: &mut Client,
    db: u32,
    big: &[Key],
    big_hint: &str,
    page: u64,
) -> anyhow::Result<Round> {
    let bytes = page as f64 * big.len() as f64;
    let pids = [dm.src.0.id(), dm.dst.0.id()];
    let daemons_cpu = || pids.iter().map(|&p| cpu_secs(p)).sum::<f64>();
    let iperf = (a.iperf_seconds > 0)
        .then(|| iperf3(a.iperf_seconds, 1))
        .transpose()?;
    let iperf_p = (a.iperf_seconds > 0 && a.connections > 1)
        .then(|| iperf3(a.iperf_seconds, a.connections))
        .transpose()?;
    let sock = (a.iperf_seconds > 0)
        .then(|| {
            let secs = f64::from(a.iperf_seconds);
            crate::socket::cold(page as usize, bytes as usize, a.connections as usize, secs)
        })
        .transpose()?;
    let memcpy = crate::memcpy::bandwidth(page as usize, bytes as usize, bytes as usize);
    let mut pulls = Vec::new();
    let c0 = daemons_cpu();
    for _ in 0..a.iterations.max(1) {
        pulls.push(bytes / pull(d, db, big, big_hint)?);
    }
    let moved_gb = bytes * pulls.len() as f64 / 1e9;
    Ok(Round {
        iperf: iperf.as_ref().map(|i| i.bps),
        iperf_p: iperf_p.as_ref().map(|i| i.bps),
        iperf_cpu: iperf.as_ref().map(|i| i.cpu_per_gb),
        iperf_p_cpu: iperf_p.as_ref().map(|i| i.cpu_per_gb),
        sock,
        pull_cpu: (daemons_cpu() - c0) / moved_gb,
        memcpy,
        pulls,
    })
}

/// Runs the benchmark.
pub fn run(a: &PullArgs) -> anyhow::Result<()> {
    let page = parse_size(&a.page_size).context("--page-size")?;
    let small = parse_size(&a.latency_page).context("--latency-page")?;
    let dm = start(a)?;
    let port = dm.port;
    let (mut s, mut d) = (
        Client::connect(&dm.src_sock)?,
        Client::connect(&dm.dst_sock)?,
    );
    let (sb, db) = (s.register(&spec(page))?.ns, d.register(&spec(page))?.ns);
    let (ss, ds) = (s.register(&spec(small))?.ns, d.register(&spec(small))?.ns);
    let big: Vec<Key> = (0..a.pages as u64).map(|i| key(1, i)).collect();
    let lat: Vec<Key> = (0..64).map(|i| key(2, i)).collect();
    put_all(&mut s, sb, &big, page)?;
    put_all(&mut s, ss, &lat, small)?;
    println!(
        "kvnode bench pull: {} x {} pages, {} rounds of {} pulls; {} latency samples of {}; {} connections; transport {}{}",
        a.pages,
        ByteSize(page),
        a.rounds,
        a.iterations,
        a.latency_samples,
        ByteSize(small),
        a.connections,
        a.transport,
        ucx_env()
    );
    settle(&mut s)?;
    settle(&mut d)?;
    let cold = pull(&mut d, ds, &lat[..1], &hint(port, &lat[..1]))?;
    let lat_h = latency(&mut d, ds, &lat, port, a.latency_samples)?;
    let floor = crate::relay::floor(small as usize, a.latency_samples.max(10))?;
    // One pull of all the small pages opens every pooled connection, so the first large
    // pull's figure is the source's hashing, not the connects and handshakes of the rest.
    pull(&mut d, ds, &lat, &hint(port, &lat))?;
    let big_hint = hint(port, &big);
    let bytes = page as f64 * a.pages as f64;
    let first = bytes / pull(&mut d, db, &big, &big_hint)?;
    let before = Counters::read(&mut d)?;
    let rounds = (0..a.rounds.max(1))
        .map(|_| round(a, &dm, &mut d, db, &big, &big_hint, page))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let measured: usize = rounds.iter().map(|r| r.pulls.len() * big.len()).sum();
    let moved = Moved::between(before, Counters::read(&mut d)?, measured as u64);
    let deliver = crate::deliver::measure(
        &mut d,
        db,
        &big,
        page,
        &big_hint,
        a.iterations.min(5),
        &page_bytes(page),
    )?;
    moved.check(&a.transport)?;
    let r = Results {
        page,
        small,
        cold,
        lat: lat_h,
        floor,
        first,
        rounds,
        deliver,
        moved,
    };
    report::report(a, &r, &d.timeouts()?);
    Ok(())
}
