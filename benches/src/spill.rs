//! `kvnode bench spill`: demotion and promotion through a real daemon next to fio in the same run.
//!
//! Starts `kvnode serve` on `--dir` with a small DRAM tier and a spill dir, puts `--size` bytes
//! (demotion paces the puts), gets every spilled block back (promotion), then runs
//! `fio --ioengine=io_uring --direct=1` with the same directory, block size and queue depth
//! (`--qd` is also the daemon's `max_in_flight`), and times recovery after SIGKILL.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvnode_client::Client;
use kvnode_proto::size::{ByteSize, parse_size};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::args::BenchSpillArgs;

fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0xb5;
    Key::page(Digest(d))
}

fn fio(dir: &Path, rw: &str, bs: u64, qd: usize, size: u64) -> anyhow::Result<f64> {
    kvnode_spill::fio::bandwidth(dir, rw, bs, qd, size).map_err(anyhow::Error::msg)
}

/// Writes the bench daemon's config: `dram`, slabs fitting `bs`-byte blocks, one spill
/// file in `spill_dir` with room for `size` bytes and a margin, `qd` writes in flight.
pub(crate) fn write_config(
    dir: &Path,
    dram: u64,
    bs: u64,
    qd: usize,
    spill_dir: &Path,
    size: u64,
) -> anyhow::Result<PathBuf> {
    let cfg = dir.join("bench.toml");
    let slab = bs.next_power_of_two().max(2 << 20);
    std::fs::write(
        &cfg,
        format!(
            "dram = \"{}\"\nslab_size = {slab}\n[spill]\nmax_in_flight = {qd}\ndirs = [{{ path = \"{}\", size = {} }}]\n",
            ByteSize(dram),
            spill_dir.display(),
            size + size / 4 + (256 << 20)
        ),
    )?;
    Ok(cfg)
}

pub(crate) struct Served {
    child: std::process::Child,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn serve(dir: &Path, cfg: &Path) -> anyhow::Result<(Served, Client, Duration)> {
    let sock = dir.join("bench.sock");
    let log = std::fs::File::create(dir.join("daemon.log"))?;
    let child = Command::new(std::env::current_exe()?)
        .args(["serve", "--no-pin", "--config"])
        .arg(cfg)
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?;
    let mut s = Served { child };
    let t = Instant::now();
    while t.elapsed() < Duration::from_mins(1) {
        // Answering, with its spill index rebuilt (it serves from DRAM while it recovers).
        if let Ok(mut c) = Client::connect(&sock)
            && c.stats().is_ok_and(|st| !st.spill_recovering)
        {
            return Ok((s, c, t.elapsed()));
        }
        if let Some(status) = s.child.try_wait()? {
            let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(3).collect();
            bail!(
                "daemon exited ({status}) before answering; its log ends:\n{}",
                tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!(
        "daemon did not start; see {}",
        dir.join("daemon.log").display()
    )
}

fn nvme_and_dram(c: &mut Client) -> anyhow::Result<(u64, u64, u64)> {
    let s = c.stats()?;
    let nvme = s.tiers.get(1).context("daemon has no nvme tier")?;
    Ok((nvme.blocks, s.tiers[0].in_flight, s.tiers[0].dropped))
}

pub fn spill(a: &BenchSpillArgs) -> anyhow::Result<()> {
    let bs = parse_size(&a.bs).context("--bs")?;
    let size = parse_size(&a.size).context("--size")?;
    let dram = parse_size(&a.dram).context("--dram")?;
    let spill_dir = a.dir.join("spill");
    let _ = std::fs::remove_dir_all(&spill_dir);
    std::fs::create_dir_all(&spill_dir)?;
    let cfg = write_config(&a.dir, dram, bs, a.qd, &spill_dir, size)?;
    let (d, mut c, _) = serve(&a.dir, &cfg)?;
    let spec = NamespaceSpec {
        model: "bench-spill".into(),
        page_size: 64,
        segments: vec![bs],
        ..NamespaceSpec::default()
    };
    let ns = c.register(&spec)?.ns;
    let n = size / bs;
    let buf = vec![0x5Au8; bs as usize];
    let batch = 4usize;
    let t = Instant::now();
    for start in (0..n).step_by(batch) {
        let keys: Vec<Key> = (start..(start + batch as u64).min(n)).map(key).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|_| buf.as_slice()).collect();
        c.put(ns, &keys, &refs)?;
    }
    while nvme_and_dram(&mut c)?.1 > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let put_s = t.elapsed().as_secs_f64();
    let (spilled, _, dropped) = nvme_and_dram(&mut c)?;
    let demote_bw = (spilled * bs) as f64 / put_s;
    // Promotion: read back the oldest blocks (all on NVMe only), qd keys per request.
    let back = spilled.min(n);
    let t = Instant::now();
    let mut got = 0u64;
    for start in (0..back).step_by(a.qd) {
        let keys: Vec<Key> = (start..(start + a.qd as u64).min(back)).map(key).collect();
        let l = c.get_lease(ns, &keys)?;
        got += l.extents.iter().flatten().count() as u64;
        if l.id != 0 {
            c.release(l.id)?;
        }
    }
    let promote_s = t.elapsed().as_secs_f64();
    let promote_bw = (got * bs) as f64 / promote_s;
    drop(c);
    // Restart after SIGKILL: time to a connectable daemon with the index rebuilt.
    drop(d);
    let (d2, mut c2, up) = serve(&a.dir, &cfg)?;
    let recovered = nvme_and_dram(&mut c2)?.0;
    drop(c2);
    drop(d2);
    let fio_w = fio(&spill_dir, "write", bs, a.qd, size)?;
    let fio_r = fio(&spill_dir, "read", bs, a.qd, size)?;
    let _ = std::fs::remove_file(spill_dir.join("fio.dat"));
    let gb = |x: f64| x / 1e9;
    println!(
        "bench spill: dir {} bs {} qd {} size {} dram {}",
        a.dir.display(),
        ByteSize(bs),
        a.qd,
        ByteSize(size),
        ByteSize(dram)
    );
    println!(
        "demotion  {:.2} GB/s ({spilled} blocks, {dropped} dropped)   fio write {:.2} GB/s   ratio {:.0}%",
        gb(demote_bw),
        gb(fio_w),
        100.0 * demote_bw / fio_w
    );
    println!(
        "promotion {:.2} GB/s ({got} blocks)   fio read  {:.2} GB/s   ratio {:.0}%",
        gb(promote_bw),
        gb(fio_r),
        100.0 * promote_bw / fio_r
    );
    println!(
        "restart after SIGKILL: {recovered} blocks indexed, daemon answering with its spill index rebuilt in {:.0} ms",
        up.as_secs_f64() * 1e3
    );
    Ok(())
}
