//! The plain-socket baseline a pull is compared with when both sides are equally cold.
//!
//! `iperf3 -l 1M` sends one 1 MiB buffer over and over and receives into one: both stay in
//! cache, so its two kernel copies are cache-to-cache. A pull moves a prefix of distinct
//! pages from the source's arena into distinct slots of the destination's, larger together
//! than the last-level cache. This baseline does what the pull does with nothing else: a
//! sender thread writes `block`-sized pieces walking a `pool`-byte buffer, a receiver
//! thread reads them into its own `pool`-byte buffer, over loopback TCP (Nagle off), in
//! `streams` connections that each walk their own part of the pools.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// What one run moved: bytes per second, and CPU seconds per GB of its threads together.
#[derive(Debug, Clone, Copy)]
pub struct Socket {
    pub bps: f64,
    pub cpu_per_gb: f64,
}

/// CPU seconds (user + system) of every thread of this process so far.
fn process_cpu() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `u` is a valid out pointer for getrusage.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// One stream's sender: `block` writes walking `pool` until `stop`, then a close.
fn send(mut s: TcpStream, block: usize, pool: usize, stop: &AtomicBool) -> std::io::Result<()> {
    let mut buf = vec![0u8; pool];
    kvnode_client::seeded::fill(11, &mut buf);
    let mut at = 0;
    while !stop.load(Ordering::Relaxed) {
        s.write_all(&buf[at..at + block])?;
        at = (at + block) % pool;
    }
    Ok(())
}

/// One stream's receiver: reads walking `pool` in `block` pieces until the sender closes,
/// counting what it got in `moved`.
fn recv(mut s: TcpStream, block: usize, pool: usize, moved: &AtomicU64) -> std::io::Result<()> {
    let mut buf = vec![1u8; pool];
    let (mut at, mut got) = (0usize, 0usize);
    loop {
        let n = s.read(&mut buf[at + got..at + block])?;
        if n == 0 {
            return Ok(());
        }
        got += n;
        moved.fetch_add(n as u64, Ordering::Relaxed);
        if got == block {
            (at, got) = ((at + block) % pool, 0);
        }
    }
}

/// Moves `block`-sized pieces of a `pool`-byte buffer over `streams` loopback connections
/// for `secs` seconds (pools touched before the clock starts).
pub fn cold(block: usize, pool: usize, streams: usize, secs: f64) -> anyhow::Result<Socket> {
    let streams = streams.max(1);
    let block = block.max(1);
    let part = (pool / streams / block).max(1) * block;
    let l = TcpListener::bind("127.0.0.1:0")?;
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..streams {
        let a = TcpStream::connect(l.local_addr()?)?;
        let (b, _) = l.accept()?;
        a.set_nodelay(true)?;
        b.set_nodelay(true)?;
        let go = Arc::clone(&stop);
        senders.push(thread::spawn(move || send(a, block, part, &go)));
        let m = Arc::clone(&moved);
        receivers.push(thread::spawn(move || recv(b, block, part, &m)));
    }
    // Let the threads fill their pools, then time a window of steady streaming.
    thread::sleep(Duration::from_millis(200));
    let (c0, b0, t0) = (process_cpu(), moved.load(Ordering::Relaxed), Instant::now());
    thread::sleep(Duration::from_secs_f64(secs.max(0.2)));
    let (cpu, bytes, dt) = (
        process_cpu() - c0,
        moved.load(Ordering::Relaxed) - b0,
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    for s in senders {
        s.join()
            .map_err(|_| anyhow::anyhow!("socket sender panicked"))?
            .context("socket baseline send")?;
    }
    for r in receivers {
        r.join()
            .map_err(|_| anyhow::anyhow!("socket receiver panicked"))?
            .context("socket baseline receive")?;
    }
    anyhow::ensure!(bytes > 0, "the socket baseline moved nothing in {dt:.2} s");
    Ok(Socket {
        bps: bytes as f64 / dt,
        cpu_per_gb: cpu / (bytes as f64 / 1e9),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn moves_bytes_and_costs_cpu() {
        let s = super::cold(64 << 10, 1 << 20, 2, 0.2).unwrap();
        assert!(s.bps > 1e6, "{s:?}");
        assert!(s.cpu_per_gb > 0.0 && s.cpu_per_gb.is_finite(), "{s:?}");
    }
}
