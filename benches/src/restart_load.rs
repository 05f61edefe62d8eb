//! The load `kvnode bench restart --load-clients N` keeps up across a restart: N clients,
//! each on its own connection, get one kept block at a time (bytes checked) and put a new
//! block every [`PUT_EVERY`] requests. A request that fails (the old daemon closed the
//! connection at its barrier) is retried on a new connection, as a client library would;
//! the retry is counted, never reported as a success early.
//!
//! Reported: the service gap (largest interval between consecutive successful answers,
//! over all clients, inside the restart window), the slowest request (first attempt to its
//! answer, retries included), retries, and every block put during the run read back from the
//! new daemon with its bytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use kvnode_client::Client;
use kvnode_proto::{Digest, Key, NamespaceSpec};

/// Key of block `i` (the restart bench's blocks and the load's).
pub(crate) fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0xc3;
    Key::page(Digest(d))
}

/// Block `i`'s bytes: its index in the first 8 bytes of a 0x5A-filled buffer.
pub(crate) fn fill(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(&i.to_le_bytes());
}

/// The bench's namespace, blocks of `bs` bytes.
pub(crate) fn spec(bs: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: "bench-restart".into(),
        // 16 tokens: with `--events` each block's router metadata (64 bytes of tokens)
        // stays within its tenant's metadata budget (1/16 of 4 KiB).
        page_size: 16,
        segments: vec![bs],
        ..NamespaceSpec::default()
    }
}

/// One put every this many requests.
pub const PUT_EVERY: u64 = 16;

/// Keys of blocks put during the run start here (client `c` puts `PUT_BASE * (c + 1) + i`).
const PUT_BASE: u64 = 1 << 40;

/// What one client saw.
#[derive(Debug, Default)]
struct Seen {
    answers: Vec<Instant>,
    slowest: Duration,
    retries: u64,
    misses: u64,
    put: Vec<u64>,
}

/// The clients, running until [`Load::stop`].
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<anyhow::Result<Seen>>>,
}

/// What the load saw across the restart window.
#[derive(Debug)]
pub struct Report {
    /// Successful answers in the window.
    pub answers: usize,
    /// Largest interval between consecutive answers in the window.
    pub gap: Duration,
    /// When the gap began, from the window's start.
    pub gap_at: Duration,
    /// The eight largest intervals (length, start from the window's start), largest first:
    /// which of them is the barrier's shows from the daemons' logs (a 2-core host with
    /// other work stalls the clients elsewhere too).
    pub largest: Vec<(Duration, Duration)>,
    /// Slowest request, retries included.
    pub slowest: Duration,
    /// Requests retried on a new connection.
    pub retries: u64,
    /// Gets of kept blocks that found nothing (a restart whose spill tier was recovering).
    pub misses: u64,
    /// Blocks put during the run (all checked after the restart).
    pub put: Vec<u64>,
}

fn connect(sock: &Path, bs: u64) -> Option<(Client, u32)> {
    let mut c = Client::connect(sock).ok()?;
    let ns = c.register(&spec(bs)).ok()?.ns;
    Some((c, ns))
}

/// One request: a get of a kept block, or a put of a new one. `Err`: the connection failed.
/// What one request did.
enum Did {
    Got,
    Missed,
    Put(Option<u64>),
}

fn one(
    c: &mut Client,
    ns: u32,
    op: u64,
    me: u64,
    blocks: u64,
    buf: &mut [u8],
) -> anyhow::Result<Did> {
    if op % PUT_EVERY == PUT_EVERY - 1 {
        let i = PUT_BASE * (me + 1) + op;
        fill(buf, i);
        let st = c.put(ns, &[key(i)], &[&*buf])?;
        return Ok(Did::Put(
            (st[0] == kvnode_proto::client::PutStatus::Stored).then_some(i),
        ));
    }
    let i = (op.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % blocks;
    let got = c.get(ns, &[key(i)])?;
    fill(buf, i);
    match &got[0] {
        Some(b) if b.as_slice() == &*buf => Ok(Did::Got),
        Some(_) => bail!("block {i} came back with other bytes"),
        None => Ok(Did::Missed),
    }
}

fn client(
    sock: &Path,
    (me, bs, blocks): (u64, u64, u64),
    misses_ok: bool,
    stop: &AtomicBool,
) -> anyhow::Result<Seen> {
    let mut seen = Seen::default();
    let mut buf = vec![0x5Au8; bs as usize];
    let mut conn = connect(sock, bs);
    let mut op = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        loop {
            if conn.is_none() {
                conn = connect(sock, bs);
            }
            let Some((c, ns)) = conn.as_mut() else {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            };
            match one(c, *ns, op, me, blocks, &mut buf) {
                Ok(Did::Put(put)) => {
                    seen.put.extend(put);
                    break;
                }
                Ok(Did::Got) => break,
                Ok(Did::Missed) if misses_ok => {
                    seen.misses += 1;
                    break;
                }
                Ok(Did::Missed) => bail!("client {me}: a kept block is missing"),
                Err(e) if e.downcast_ref::<kvnode_client::ClientError>().is_some() => {
                    seen.retries += 1;
                    conn = None;
                }
                Err(e) => return Err(e),
            }
            if t.elapsed() > Duration::from_mins(2) {
                bail!("client {me}: no answer for 2 minutes");
            }
        }
        let now = Instant::now();
        seen.slowest = seen.slowest.max(now - t);
        seen.answers.push(now);
        op += 1;
    }
    Ok(seen)
}

impl Load {
    /// Starts `n` clients against the daemon on `sock` holding blocks `0..blocks`; a kept
    /// block that is missing is an error.
    pub fn start(sock: &Path, n: u64, bs: u64, blocks: u64) -> Self {
        Self::start_with(sock, n, bs, blocks, false)
    }

    /// Like [`Load::start`], counting a kept block that is missing (a restart whose spill
    /// tier is being recovered serves from DRAM meanwhile) instead of failing.
    pub fn start_missing(sock: &Path, n: u64, bs: u64, blocks: u64) -> Self {
        Self::start_with(sock, n, bs, blocks, true)
    }

    fn start_with(sock: &Path, n: u64, bs: u64, blocks: u64, misses_ok: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|me| {
                let (sock, stop): (PathBuf, _) = (sock.to_owned(), Arc::clone(&stop));
                std::thread::spawn(move || client(&sock, (me, bs, blocks), misses_ok, &stop))
            })
            .collect();
        Self { stop, threads }
    }

    /// Stops the clients; what they saw between `from` and `to`.
    pub fn stop(self, from: Instant, to: Instant) -> anyhow::Result<Report> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        let (mut slowest, mut retries, mut misses, mut put) = (Duration::ZERO, 0, 0, Vec::new());
        for t in self.threads {
            let Ok(s) = t.join() else {
                bail!("a load client panicked")
            };
            let s = s?;
            all.extend(s.answers.into_iter().filter(|&a| a >= from && a <= to));
            slowest = slowest.max(s.slowest);
            retries += s.retries;
            misses += s.misses;
            put.extend(s.put);
        }
        all.sort_unstable();
        let mut edges = vec![from];
        edges.extend(&all);
        edges.push(to);
        let mut gaps: Vec<(Duration, Duration)> = edges
            .windows(2)
            .map(|w| (w[1] - w[0], w[0] - from))
            .collect();
        gaps.sort_unstable_by(|a, b| b.cmp(a));
        gaps.truncate(8);
        let (gap, at) = gaps.first().copied().unwrap_or_default();
        Ok(Report {
            answers: all.len(),
            gap,
            gap_at: at,
            largest: gaps,
            slowest,
            retries,
            misses,
            put,
        })
    }
}

/// Reads every block put during the run back from the daemon on `sock`; how many came back
/// with their bytes (a wrong byte is an error).
pub fn check_put(sock: &Path, bs: u64, put: &[u64]) -> anyhow::Result<u64> {
    let Some((mut c, ns)) = connect(sock, bs) else {
        bail!("cannot connect to check the blocks put during the restart")
    };
    let mut want = vec![0x5Au8; bs as usize];
    let mut n = 0;
    for chunk in put.chunks(32) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        for (g, &i) in c.get(ns, &keys)?.iter().zip(chunk) {
            fill(&mut want, i);
            match g {
                Some(b) if *b == want => n += 1,
                Some(_) => bail!("block {i}, put during the restart, came back with other bytes"),
                None => {}
            }
        }
    }
    Ok(n)
}

/// Prints what the load clients saw across `what` (offsets from `from`) and checks their
/// puts: an error if one of them is not read back with its bytes.
pub fn report(r: &Report, sock: &Path, bs: u64, what: &str, from: &str) -> anyhow::Result<()> {
    let back = check_put(sock, bs, &r.put)?;
    println!(
        "load across {what}: {} answers, service gap {:.1} ms (at {:.0} ms after {from}), slowest request {:.1} ms, {} requests retried on a new connection, {back}/{} blocks put during the run read back intact",
        r.answers,
        r.gap.as_secs_f64() * 1e3,
        r.gap_at.as_secs_f64() * 1e3,
        r.slowest.as_secs_f64() * 1e3,
        r.retries,
        r.put.len()
    );
    let largest: Vec<String> = r
        .largest
        .iter()
        .map(|(g, at)| {
            format!(
                "{:.1} ms at {:.0} ms",
                g.as_secs_f64() * 1e3,
                at.as_secs_f64() * 1e3
            )
        })
        .collect();
    println!("largest intervals: {}", largest.join(", "));
    if r.misses > 0 {
        println!(
            "{} gets of kept blocks missed (the spill tier was being recovered)",
            r.misses
        );
    }
    if back != r.put.len() as u64 {
        bail!(
            "{} blocks put during {what} were lost",
            r.put.len() as u64 - back
        );
    }
    Ok(())
}
