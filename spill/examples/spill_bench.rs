//! Measures demotion-style writes and promotion-style reads between a registered arena and the
//! spill tier, next to `fio --ioengine=io_uring --direct=1` on the same directory, block size
//! and queue depth, and prints the ratios; optionally times index recovery of N blocks.
//!
//! Run: `cargo run --release -p kvnode-spill --example spill_bench -- --dir /var/tmp/x
//! --bs 1M --qd 8 --size 2G [--sync-ms 1000 (0: off)] [--recovery 100000 [--clean-only]
//! [--engine uring|psync]] [--no-fio]`

use anyhow::{Context, bail, ensure};
use kvnode_spill::{
    ArenaSlice, Completion, Done, IoBuf, ReadOutcome, SpillConfig, SpillKey, SpillTier,
};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Instant;

struct Args {
    dir: PathBuf,
    bs: usize,
    qd: usize,
    size: u64,
    recovery: Option<u64>,
    fio: bool,
    sync_ms: Option<u64>,
    /// `psync` (page cache; file systems without O_DIRECT such as tmpfs) instead of io_uring.
    psync: bool,
    /// Recovery after a clean shutdown only (not also after a crash).
    clean_only: bool,
}

fn parse_size(s: &str) -> anyhow::Result<u64> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num
        .parse::<u64>()
        .with_context(|| format!("bad size {s}"))?
        * mul)
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        dir: "/var/tmp/kvnode-spill-bench".into(),
        bs: 1 << 20,
        qd: 8,
        size: 2 << 30,
        recovery: None,
        fio: true,
        sync_ms: Some(1000),
        psync: false,
        clean_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--dir" => a.dir = v()?.into(),
            "--bs" => a.bs = parse_size(&v()?)? as usize,
            "--qd" => a.qd = v()?.parse()?,
            "--size" => a.size = parse_size(&v()?)?,
            "--recovery" => a.recovery = Some(v()?.parse()?),
            "--no-fio" => a.fio = false,
            "--engine" => {
                a.psync = match v()?.as_str() {
                    "psync" => true,
                    "uring" => false,
                    e => bail!("--engine {e}: uring or psync"),
                }
            }
            "--clean-only" => a.clean_only = true,
            "--sync-ms" => a.sync_ms = Some(v()?.parse::<u64>()?).filter(|&ms| ms > 0),
            other => bail!("unknown argument {other}"),
        }
    }
    ensure!(
        a.bs.is_multiple_of(4096) && a.bs > 0,
        "--bs must be a multiple of 4096"
    );
    Ok(a)
}

fn key(i: u64) -> SpillKey {
    let mut digest = [0u8; 32];
    digest[..8].copy_from_slice(&i.to_le_bytes());
    SpillKey {
        namespace: 1,
        digest,
        segment: 0,
    }
}

/// Anonymous populated mapping standing in for the engine's DRAM arena.
fn map(len: usize) -> anyhow::Result<*mut u8> {
    // SAFETY: anonymous mapping, checked for failure; never unmapped (process lifetime).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    ensure!(p != libc::MAP_FAILED, "mmap of {len} bytes failed");
    Ok(p.cast())
}

/// Runs `n` operations keeping `qd` in flight; returns seconds.
fn pipeline<T>(
    n: u64,
    qd: usize,
    mut submit: impl FnMut(u64) -> Completion<Done<T>>,
    mut check: impl FnMut(Done<T>) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut q = VecDeque::new();
    for i in 0..n {
        if q.len() >= qd {
            check(q.pop_front().map(Completion::wait).context("queue")?)?;
        }
        q.push_back(submit(i));
    }
    for c in q {
        check(c.wait())?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn fio(dir: &Path, rw: &str, bs: usize, qd: usize, size: u64) -> anyhow::Result<f64> {
    let bps =
        kvnode_spill::fio::bandwidth(dir, rw, bs as u64, qd, size).map_err(anyhow::Error::msg)?;
    Ok(bps / 1e9)
}

fn throughput(a: &Args) -> anyhow::Result<()> {
    let n = a.size / a.bs as u64;
    let region = (64u64 << 20).max(4 * a.bs as u64);
    let file = a.size + a.size / 16 + 3 * region;
    let tdir = a.dir.join("tier");
    let _ = std::fs::remove_dir_all(&tdir);
    let sync = a.sync_ms.map(std::time::Duration::from_millis);
    let cfg = SpillConfig::builder()
        .dir(&tdir, file)
        .region_size(region)
        .max_block_size(a.bs)
        .queue_depth(a.qd)
        .sync_interval(sync)
        .build()?;
    let tier = SpillTier::open(cfg)?;
    let slots = ((1usize << 30) / a.bs).clamp(2 * a.qd, n as usize);
    let arena_len = slots * a.bs;
    let arena = map(arena_len)?;
    for (i, b) in (0..arena_len).step_by(4096).enumerate() {
        // SAFETY: in bounds of the mapping.
        unsafe { *arena.add(b) = i as u8 };
    }
    // SAFETY: the mapping lives for the whole process; each slot is used by one op at a time.
    unsafe { tier.register_arena(arena, arena_len)? };
    let slice = |i: u64| {
        IoBuf::Arena(ArenaSlice {
            offset: (i as usize % slots) * a.bs,
            len: a.bs,
        })
    };
    // Each side reads back what it has just written (same host-cache conditions).
    let fio_w = if a.fio {
        Some(fio(&a.dir, "write", a.bs, a.qd, a.size)?)
    } else {
        None
    };
    let fio_r = if a.fio {
        Some(fio(&a.dir, "read", a.bs, a.qd, a.size)?)
    } else {
        None
    };
    let wsecs = pipeline(
        n,
        a.qd,
        |i| tier.write(key(i), slice(i)),
        |d| d.result.map(|_| ()).map_err(Into::into),
    )?;
    let rsecs = pipeline(
        n,
        a.qd,
        |i| tier.read(key(i), slice(i)),
        |d| match d.result? {
            ReadOutcome::Hit { .. } => Ok(()),
            miss => bail!("unexpected {miss:?}"),
        },
    )?;
    let gb = (n * a.bs as u64) as f64 / 1e9;
    let (wgb, rgb) = (gb / wsecs, gb / rsecs);
    let s = tier.stats();
    println!(
        "spill_bench dir={} bs={} qd={} size={} blocks={n}",
        a.dir.display(),
        a.bs,
        a.qd,
        a.size
    );
    println!("kvnode demote (write, arena WRITE_FIXED): {wgb:.3} GB/s");
    println!("kvnode promote (read, arena READ_FIXED):  {rgb:.3} GB/s");
    if let (Some(fw), Some(fr)) = (fio_w, fio_r) {
        println!(
            "fio io_uring direct write: {fw:.3} GB/s   ratio kvnode/fio {:.1} %",
            100.0 * wgb / fw
        );
        println!(
            "fio io_uring direct read:  {fr:.3} GB/s   ratio kvnode/fio {:.1} %",
            100.0 * rgb / fr
        );
    }
    println!(
        "bounce copies {}, checksum failures {}, evictions {}",
        s.bounce_copies, s.checksum_failures, s.evictions
    );
    drop(tier);
    let _ = std::fs::remove_file(a.dir.join("fio.dat"));
    let _ = std::fs::remove_dir_all(&tdir);
    Ok(())
}

fn recovery(a: &Args, n: u64) -> anyhow::Result<()> {
    let tdir = a.dir.join("recovery");
    let passes: &[bool] = if a.clean_only {
        &[true]
    } else {
        &[true, false]
    };
    let engine = if a.psync {
        kvnode_spill::IoEngineKind::Psync
    } else {
        kvnode_spill::IoEngineKind::Uring
    };
    for &seal in passes {
        let _ = std::fs::remove_dir_all(&tdir);
        let region = 64u64 << 20;
        let cfg = || {
            SpillConfig::builder()
                .engine(engine.clone())
                .dir(&tdir, n * 8192 + n * 128 + 4 * region)
                .region_size(region)
                .max_block_size(1 << 20)
                .seal_on_shutdown(seal)
                .queue_depth(32)
        };
        let tier = SpillTier::open(cfg().build()?)?;
        let payload = kvnode_spill::AlignedBuf::from_slice(&[7u8; 4096]);
        let t0 = Instant::now();
        pipeline(
            n,
            32,
            |i| {
                tier.write(
                    key(i),
                    IoBuf::Aligned(kvnode_spill::AlignedBuf::from_slice(&payload)),
                )
            },
            |d| d.result.map(|_| ()).map_err(Into::into),
        )?;
        let fill = t0.elapsed();
        drop(tier);
        let tier = SpillTier::open(cfg().seal_on_shutdown(true).build()?)?;
        let r = tier.recovery();
        ensure!(r.blocks == n, "recovered {} of {n}", r.blocks);
        let how = if seal {
            "after clean shutdown"
        } else {
            "after crash (open region scanned)"
        };
        println!(
            "recovery of {n} blocks {how}: {:.3} s (fill took {:.1} s; {} summaries, {} scanned regions)",
            r.elapsed.as_secs_f64(),
            fill.as_secs_f64(),
            r.files[0].summaries,
            r.files[0].scanned
        );
    }
    let _ = std::fs::remove_dir_all(&tdir);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    std::fs::create_dir_all(&a.dir)?;
    if let Some(n) = a.recovery {
        recovery(&a, n)?;
    } else {
        throughput(&a)?;
    }
    Ok(())
}
