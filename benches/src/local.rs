//! `kvnode bench local`: load against a running daemon, next to memcpy measured in the same run.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kvnode_client::Client;
use kvnode_proto::client::PutStatus;
use kvnode_proto::size::{ByteSize, parse_size};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::args::{BenchArgs, BenchMode, BenchOp};

/// Source and destination sizes of the memcpy baseline that match what `op` copies: a get
/// reads the working set out of the arena into one reused batch buffer; a put copies one
/// reused page into fresh slots that walk the DRAM tier (`pool`, default 1 GiB).
fn baseline_pools(a: &BenchArgs, page: u64, pool: usize) -> (usize, usize) {
    let page = page as usize;
    match a.op {
        BenchOp::Put => (page, pool),
        _ => (page * a.working_set, page * a.batch),
    }
}

/// Largest buffer the bench allocates on the client side (batch, working-set copy, pool).
const MAX_BUFFER: u64 = 64 << 30;

fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[8..16].copy_from_slice(&(!i).to_le_bytes());
    Key::page(Digest(d))
}

struct Outcome {
    hist: Histogram<u64>,
    requests: u64,
    pages: u64,
    bytes: u64,
}

fn spec(page: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: format!("bench-{}", ByteSize(page)),
        page_size: 64,
        segments: vec![page],
        ..NamespaceSpec::default()
    }
}

fn prefill(c: &mut Client, ns: u32, page: u64, n: usize) -> anyhow::Result<()> {
    let buf = vec![0xA5u8; page as usize];
    let per = ((64 << 20) / page).max(1) as usize;
    for start in (0..n).step_by(per) {
        let ks: Vec<Key> = (start..(start + per).min(n))
            .map(|i| key(i as u64))
            .collect();
        let blocks: Vec<&[u8]> = ks.iter().map(|_| buf.as_slice()).collect();
        let r = c.put(ns, &ks, &blocks)?;
        if let Some(bad) = r
            .iter()
            .find(|s| !matches!(s, PutStatus::Stored | PutStatus::Exists))
        {
            bail!("prefill failed: {bad:?} (working set larger than the DRAM tier?)");
        }
    }
    Ok(())
}

fn worker(a: &BenchArgs, thread: usize, page: u64, deadline: Instant) -> anyhow::Result<Outcome> {
    let mut c = Client::connect(a.socket.path())?;
    let ns = c.register(&spec(page))?.ns;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut dst = vec![0u8; page as usize * a.batch];
    let src = vec![0x5Au8; page as usize];
    let (mut requests, mut pages, mut bytes) = (0u64, 0u64, 0u64);
    let ws = a.working_set as u64;
    let mut cursor = (thread as u64 * 7919) % ws.max(1);
    let mut fresh = (thread as u64) << 40 | 1 << 62;
    while Instant::now() < deadline {
        let ks: Vec<Key> = match a.op {
            BenchOp::Put => (0..a.batch)
                .map(|_| {
                    fresh += 1;
                    key(fresh)
                })
                .collect(),
            _ => (0..a.batch as u64)
                .map(|j| key((cursor + j) % ws))
                .collect(),
        };
        cursor = (cursor + a.batch as u64) % ws.max(1);
        let t = Instant::now();
        let got = match (a.op, a.mode) {
            (BenchOp::Put, _) => {
                let blocks: Vec<&[u8]> = ks.iter().map(|_| src.as_slice()).collect();
                let r = c.put(ns, &ks, &blocks)?;
                r.iter().filter(|s| **s == PutStatus::Stored).count() as u64 * page
            }
            (BenchOp::Exists, _) => {
                c.exists(ns, &ks)?;
                0
            }
            (BenchOp::Get, BenchMode::Inline) => {
                let mut bufs: Vec<&mut [u8]> = dst.chunks_mut(page as usize).collect();
                c.get_into(ns, &ks, &mut bufs)?.iter().flatten().sum()
            }
            (BenchOp::Get, BenchMode::ZeroCopy) => {
                let lease = c.get_lease(ns, &ks)?;
                let mut n = 0;
                for (e, d) in lease.extents.iter().zip(dst.chunks_mut(page as usize)) {
                    if let Some(e) = e {
                        d[..e.len as usize].copy_from_slice(c.arena().read(*e));
                        n += e.len;
                    }
                }
                if lease.id != 0 {
                    c.release(lease.id)?;
                }
                n
            }
        };
        hist.saturating_record(t.elapsed().as_micros().max(1) as u64);
        requests += 1;
        pages += ks.len() as u64;
        bytes += got;
    }
    Ok(Outcome {
        hist,
        requests,
        pages,
        bytes,
    })
}

/// Runs the benchmark and prints the report.
pub fn local(a: &BenchArgs) -> anyhow::Result<()> {
    let page = parse_size(&a.page_size).context("--page-size")?;
    let pool = parse_size(&a.memcpy_pool).context("--memcpy-pool")? as usize;
    if a.batch == 0 || a.concurrency == 0 || a.working_set == 0 {
        bail!("--batch, --concurrency and --working-set must be positive");
    }
    // Buffers of these sizes are allocated here: refuse sizes no machine holds.
    for (what, n) in [("--batch", a.batch), ("--working-set", a.working_set)] {
        if page.checked_mul(n as u64).is_none_or(|b| b > MAX_BUFFER) {
            bail!("--page-size x {what} exceeds {}", ByteSize(MAX_BUFFER));
        }
    }
    if pool as u64 > MAX_BUFFER {
        bail!("--memcpy-pool exceeds {}", ByteSize(MAX_BUFFER));
    }
    let mut c = Client::connect(a.socket.path()).context("connecting to the daemon")?;
    let ns = c.register(&spec(page))?.ns;
    if a.op != BenchOp::Put {
        prefill(&mut c, ns, page, a.working_set)?;
    }
    println!(
        "kvnode bench local: op={:?} mode={:?} page={} batch={} concurrency={} duration={}s working_set={}",
        a.op,
        a.mode,
        ByteSize(page),
        a.batch,
        a.concurrency,
        a.duration,
        a.working_set
    );
    let (src_pool, dst_pool) = baseline_pools(a, page, pool);
    let memcpy = crate::memcpy::bandwidth(page as usize, src_pool, dst_pool);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(a.duration);
    let outs: Vec<anyhow::Result<Outcome>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..a.concurrency)
            .map(|t| s.spawn(move || worker(a, t, page, deadline)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench worker panicked"))
            .collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut requests, mut pages, mut bytes) = (0u64, 0u64, 0u64);
    for o in outs {
        let o = o?;
        hist.add(&o.hist)?;
        requests += o.requests;
        pages += o.pages;
        bytes += o.bytes;
    }
    let gbps = bytes as f64 / secs / 1e9;
    println!(
        "requests: {requests} ({:.0}/s), keys: {:.0}/s",
        requests as f64 / secs,
        pages as f64 / secs
    );
    println!(
        "latency per request (us): p50 {} p90 {} p99 {} p99.9 {} max {}",
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.9),
        hist.value_at_quantile(0.99),
        hist.value_at_quantile(0.999),
        hist.max()
    );
    println!(
        "memcpy (1 thread, {} blocks, source walking {}, destination walking {}, as the bench does): {:.2} GB/s",
        ByteSize(page),
        ByteSize(src_pool as u64),
        ByteSize(dst_pool as u64),
        memcpy / 1e9
    );
    if a.op != BenchOp::Exists {
        println!(
            "throughput: {gbps:.2} GB/s = {:.2} x memcpy",
            gbps * 1e9 / memcpy
        );
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "op": format!("{:?}", a.op), "mode": format!("{:?}", a.mode), "page": page,
                "batch": a.batch, "concurrency": a.concurrency, "secs": secs,
                "requests_per_s": requests as f64 / secs, "keys_per_s": pages as f64 / secs,
                "gbps": gbps, "memcpy_gbps": memcpy / 1e9, "ratio": gbps * 1e9 / memcpy,
                "p50_us": hist.value_at_quantile(0.5), "p99_us": hist.value_at_quantile(0.99),
            })
        );
    }
    Ok(())
}
