//! `kvnode bench events`: KV events a live ZMQ subscriber receives while the daemon serves puts.
//!
//! Starts `kvnode serve --events ipc://DIR/events.sock` with a small DRAM tier (so puts also
//! evict: every put is a `BlockStored`, every eviction a `BlockRemoved`), subscribes, puts
//! token-annotated pages for `--duration` seconds, then checks that the subscriber saw every
//! batch (consecutive sequence numbers) and as many events as the daemon's stores + evictions.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use kvnode_client::Client;
use kvnode_proto::client::BlockMeta;
use kvnode_proto::{Digest, Key, NamespaceSpec};
use zeromq::{Socket, SocketRecv, SubSocket};

/// `bench events` flags.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Seconds of puts.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Pages per put request.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// DRAM tier of the daemon (4 KiB pages: 16 MiB holds 4096 before evictions start).
    #[arg(long, default_value = "16MiB")]
    pub dram: String,
}

struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Default)]
struct Seen {
    batches: u64,
    events: u64,
    gaps: u64,
    first: Option<u64>,
    last: Option<u64>,
}

/// Subscribes and counts until `stop` is set and the stream has been quiet for 500 ms.
async fn subscribe(
    endpoint: String,
    stop: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
) -> anyhow::Result<Seen> {
    let mut sub = SubSocket::new();
    sub.connect(&endpoint).await?;
    sub.subscribe("").await?;
    let mut seen = Seen::default();
    loop {
        let msg = match tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
            Ok(m) => m?,
            Err(_) if stop.load(Ordering::Relaxed) => return Ok(seen),
            Err(_) => continue,
        };
        ready.store(true, Ordering::Relaxed);
        ensure!(msg.len() == 3, "a message of {} frames (want 3)", msg.len());
        let seq_b = msg.get(1).context("seq frame")?;
        let seq = u64::from_be_bytes(seq_b.as_ref().try_into().context("8-byte seq")?);
        let (_ts, events, _rank): (f64, Vec<serde::de::IgnoredAny>, Option<i64>) =
            rmp_serde::from_slice(msg.get(2).context("payload frame")?)?;
        if let Some(last) = seen.last
            && seq != last + 1
        {
            seen.gaps += 1;
        }
        seen.first.get_or_insert(seq);
        seen.last = Some(seq);
        seen.batches += 1;
        seen.events += events.len() as u64;
    }
}

fn page(i: u64, prev: Option<Digest>) -> (Key, BlockMeta) {
    let tokens: Vec<u32> = (0..16).map(|t| (i * 16 + t) as u32).collect();
    let d = kvnode_proto::hash::page_digest(prev.as_ref(), &tokens);
    (
        Key::page(d),
        BlockMeta {
            tokens,
            parent: prev,
        },
    )
}

/// Starts `kvnode serve --events` in `dir` and connects to it.
fn start_daemon(
    dram: &str,
    dir: &std::path::Path,
    endpoint: &str,
) -> anyhow::Result<(Daemon, Client)> {
    let sock = dir.join("bench.sock");
    let log = std::fs::File::create(dir.join("daemon.log"))?;
    let daemon = Daemon(
        Command::new(std::env::current_exe()?)
            .args([
                "serve", "--no-pin", "--dram", dram, "--events", endpoint, "--socket",
            ])
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
    );
    let t = Instant::now();
    loop {
        if let Ok(c) = Client::connect(&sock) {
            return Ok((daemon, c));
        }
        ensure!(
            t.elapsed() < Duration::from_secs(20),
            "daemon did not start; see {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs the benchmark.
pub fn run(a: &EventsArgs) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvnode-bench-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let endpoint = format!("ipc://{}", dir.join("events.sock").display());
    let (_daemon, mut c) = start_daemon(&a.dram, &dir, &endpoint)?;
    let spec = NamespaceSpec {
        model: "bench-events".into(),
        page_size: 16,
        segments: vec![4096],
        ..NamespaceSpec::default()
    };
    let ns = c.register(&spec)?.ns;
    let (stop, ready) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let sub = {
        let (stop, ready, ep) = (Arc::clone(&stop), Arc::clone(&ready), endpoint.clone());
        std::thread::spawn(move || rt.block_on(subscribe(ep, stop, ready)))
    };
    let body = vec![0x3cu8; 4096];
    let mut i = 0u64;
    let mut prev = None;
    let mut put_batch = |c: &mut Client, n: usize| -> anyhow::Result<()> {
        let (ks, metas): (Vec<Key>, Vec<Option<BlockMeta>>) = (0..n)
            .map(|_| {
                let (k, m) = page(i, prev);
                prev = Some(k.0);
                i += 1;
                (k, Some(m))
            })
            .unzip();
        let blocks: Vec<&[u8]> = ks.iter().map(|_| body.as_slice()).collect();
        c.put_with_meta(ns, &ks, &blocks, metas)?;
        Ok(())
    };
    // Slow-joiner: warm up until the subscriber sees a batch, then measure.
    let t = Instant::now();
    while !ready.load(Ordering::Relaxed) {
        put_batch(&mut c, 1)?;
        ensure!(
            t.elapsed() < Duration::from_secs(10),
            "subscriber received nothing"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = c.stats()?.tiers[0].clone();
    let start = Instant::now();
    let mut puts = 0u64;
    while start.elapsed().as_secs_f64() < a.duration {
        put_batch(&mut c, a.batch)?;
        puts += a.batch as u64;
    }
    let put_secs = start.elapsed().as_secs_f64();
    let after = c.stats()?.tiers[0].clone();
    stop.store(true, Ordering::Relaxed);
    let seen = sub
        .join()
        .map_err(|_| anyhow::anyhow!("subscriber panicked"))??;
    let expected = (after.inserts - before.inserts) + (after.evictions - before.evictions);
    let rate = expected as f64 / put_secs;
    println!(
        "bench events: {puts} pages put in {put_secs:.2}s ({:.0} pages/s), batch {}",
        puts as f64 / put_secs,
        a.batch
    );
    println!(
        "daemon: {} stores + {} evictions = {expected} block events in the measured window ({rate:.0} events/s)",
        after.inserts - before.inserts,
        after.evictions - before.evictions
    );
    println!(
        "subscriber: {} batches, {} events in all (warm-up included), seq {:?}..{:?}, gaps {}",
        seen.batches, seen.events, seen.first, seen.last, seen.gaps
    );
    let _ = std::fs::remove_dir_all(&dir);
    if seen.gaps > 0 || seen.events < expected {
        bail!(
            "events were lost: {} gaps, {} events seen for {expected} expected",
            seen.gaps,
            seen.events
        );
    }
    println!("no loss; publish rate {rate:.0} block events/s while serving puts");
    Ok(())
}
