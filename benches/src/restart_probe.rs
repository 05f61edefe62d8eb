//! What `kvnode bench restart` measures of the filled daemon before it restarts it: heap per
//! block (the daemon's `RssAnon`: the arena is a shared memfd, so anonymous memory is the
//! heap) and single-key `exists`, `get` and `put` latency at that size (issue 42 item 3:
//! lookups flat from 10 k to 10 M blocks).

use std::time::Instant;

use anyhow::Context;
use hdrhistogram::Histogram;
use kvnode_client::Client;
use kvnode_proto::Key;

use crate::restart_load::{fill, key, spec};

/// The `RssAnon` of process `pid`, in bytes.
pub fn rss_anon(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no RssAnon line")?;
    Ok(kib * 1024)
}

/// Latency of one operation, in nanoseconds.
#[derive(Debug)]
pub struct Lat(Histogram<u64>);

impl std::fmt::Display for Lat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |q: f64| self.0.value_at_quantile(q) as f64 / 1e3;
        write!(f, "p50 {:.1} us p99 {:.1} us", us(0.5), us(0.99))
    }
}

/// Single-key latencies at the filled size.
#[derive(Debug)]
pub struct Probe {
    /// Requests of each kind.
    pub n: u64,
    /// `exists` of a resident key.
    pub exists: Lat,
    /// `get` of a resident key (bytes copied back).
    pub get: Lat,
    /// `put` of a new key.
    pub put: Lat,
}

/// Measures `n` single-key requests of each kind against blocks `0..blocks` (keys picked by
/// a fixed pseudo-random walk, so every size sees lookups spread over its whole index).
pub fn probe(c: &mut Client, bs: u64, blocks: u64, n: u64) -> anyhow::Result<Probe> {
    let ns = c.register(&spec(bs))?.ns;
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % blocks.max(1)
    };
    let new = || Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3);
    let (mut ex, mut get, mut put) = (new()?, new()?, new()?);
    for _ in 0..n {
        let k = [key(next())];
        let t = Instant::now();
        let found = c.exists(ns, &k)?;
        ex.saturating_record(t.elapsed().as_nanos() as u64);
        anyhow::ensure!(found == 1, "a filled block is missing");
    }
    for _ in 0..n {
        let k = [key(next())];
        let t = Instant::now();
        let got = c.get(ns, &k)?;
        get.saturating_record(t.elapsed().as_nanos() as u64);
        anyhow::ensure!(got[0].is_some(), "a filled block is missing");
    }
    let mut buf = vec![0x5Au8; bs as usize];
    for i in 0..n {
        // New keys above the filled ones (the tier makes room as it would for any put).
        let k: [Key; 1] = [key(blocks + i)];
        fill(&mut buf, blocks + i);
        let t = Instant::now();
        c.put(ns, &k, &[buf.as_slice()])?;
        put.saturating_record(t.elapsed().as_nanos() as u64);
    }
    Ok(Probe {
        n,
        exists: Lat(ex),
        get: Lat(get),
        put: Lat(put),
    })
}

/// What was measured of the filled daemon.
#[derive(Debug)]
pub struct Filled {
    /// `RssAnon` before the fill.
    heap0: u64,
    /// `RssAnon` after it.
    heap: u64,
    /// Latencies, when asked for.
    lat: Option<Probe>,
}

impl Filled {
    /// Reads the heap of the daemon `pid` (`heap0` before the fill) and, with `probes` > 0,
    /// times that many requests of each kind (blocks `0..blocks` of `bs` bytes filled).
    pub fn measure(
        c: &mut Client,
        pid: u32,
        heap0: u64,
        bs: u64,
        blocks: u64,
        probes: u64,
    ) -> anyhow::Result<Self> {
        let heap = rss_anon(pid)?;
        let lat = (probes > 0)
            .then(|| probe(c, bs, blocks, probes))
            .transpose()?;
        Ok(Self { heap0, heap, lat })
    }

    /// Prints the heap per block of `blocks` and the latencies.
    pub fn print(&self, blocks: u64) {
        println!(
            "heap (RssAnon) of the filled daemon: {} bytes after the fill, {} before: {:.1} bytes per block",
            self.heap,
            self.heap0,
            self.heap.saturating_sub(self.heap0) as f64 / blocks.max(1) as f64
        );
        if let Some(p) = &self.lat {
            println!(
                "single-key latency at {blocks} blocks ({} requests each): exists {}; get {}; put {}",
                p.n, p.exists, p.get, p.put
            );
        }
    }
}
