//! `kvnode bench backpressure`: puts offered faster than the disk can take them (issue 15 §3).
//!
//! First measures the disk: `fio --ioengine=io_uring --direct=1 --rw=write` of `--size` on a
//! fresh file in `--dir` (the same file system the spill file lives on), then deletes it.
//! Then starts a daemon with a small DRAM tier and a fresh spill file in the same directory
//! (both equally cold: new files, nothing cached) and offers puts of `--batch` × `--bs`
//! paced at `--load` × the fio rate, for `--size` bytes in all. Puts cannot outrun the
//! disk once DRAM is full, so each waits for demotion (backpressure). Reported: every put's
//! status (the target is no refusal), blocks evicted without a copy (`dropped`), and the put
//! throughput (bytes acknowledged / time to the last acknowledgement) against fio's.

use std::time::{Duration, Instant};

use anyhow::Context;
use kvnode_proto::client::PutStatus;
use kvnode_proto::size::{ByteSize, parse_size};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::args::BackpressureArgs;

fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0xbb;
    Key::page(Digest(d))
}

/// Runs the benchmark.
pub fn run(a: &BackpressureArgs) -> anyhow::Result<()> {
    let bs = parse_size(&a.bs).context("--bs")?;
    let size = parse_size(&a.size).context("--size")?;
    let dram = parse_size(&a.dram).context("--dram")?;
    let _ = std::fs::remove_dir_all(&a.dir);
    let spill_dir = a.dir.join("spill");
    std::fs::create_dir_all(&spill_dir)?;
    let fio_w = kvnode_spill::fio::bandwidth(&spill_dir, "write", bs, a.qd, size)
        .map_err(anyhow::Error::msg)?;
    let _ = std::fs::remove_file(spill_dir.join("fio.dat"));
    let cfg = crate::spill::write_config(&a.dir, dram, bs, a.qd, &spill_dir, size)?;

    let (d, mut c, _) = crate::spill::serve(&a.dir, &cfg)?;
    let spec = NamespaceSpec {
        model: "bench-backpressure".into(),
        page_size: 64,
        segments: vec![bs],
        ..NamespaceSpec::default()
    };
    let ns = c.register(&spec)?.ns;
    let n = size / bs;
    let buf = vec![0xA5u8; bs as usize];
    let rate = fio_w * a.load;
    let mut statuses = std::collections::BTreeMap::<String, u64>::new();
    let (mut stored, mut sent) = (0u64, 0u64);
    let mut late = Duration::ZERO;
    let t = Instant::now();
    for start in (0..n).step_by(a.batch) {
        // Pace the offer: this request is due when the bytes before it would have been
        // written at `rate`.
        let due = Duration::from_secs_f64(sent as f64 / rate);
        match due.checked_sub(t.elapsed()) {
            Some(wait) => std::thread::sleep(wait),
            None => late = late.max(t.elapsed().saturating_sub(due)),
        }
        let keys: Vec<Key> = (start..(start + a.batch as u64).min(n)).map(key).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|_| buf.as_slice()).collect();
        for s in c.put(ns, &keys, &refs)? {
            if s == PutStatus::Stored {
                stored += 1;
            }
            *statuses.entry(format!("{s:?}")).or_default() += 1;
        }
        sent += keys.len() as u64 * bs;
    }
    let put_s = t.elapsed().as_secs_f64();
    while c.stats()?.tiers[0].in_flight > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let drained_s = t.elapsed().as_secs_f64();
    let s = c.stats()?;
    let dropped = s.tiers[0].dropped;
    let nvme_blocks = s.tiers.get(1).map_or(0, |t| t.blocks);
    drop(c);
    drop(d);
    let _ = std::fs::remove_dir_all(&spill_dir);
    let ceiling = put_ceiling(a, bs, &spec, &buf)?;
    let put_bw = (stored * bs) as f64 / put_s;
    let disk_bw = (nvme_blocks * bs) as f64 / drained_s;
    let gb = |x: f64| x / 1e9;
    println!(
        "bench backpressure: dir {} bs {} batch {} size {} dram {} qd {} offered {:.1} x fio",
        a.dir.display(),
        ByteSize(bs),
        a.batch,
        ByteSize(size),
        ByteSize(dram),
        a.qd,
        a.load
    );
    println!(
        "fio write {:.3} GB/s; offered {:.3} GB/s; requests fell behind the offer by up to {:.1} s (backpressure)",
        gb(fio_w),
        gb(rate),
        late.as_secs_f64()
    );
    println!(
        "puts: {statuses:?}; {dropped} blocks evicted without a copy; {nvme_blocks} on NVMe after the run"
    );
    println!(
        "put throughput {:.3} GB/s = {:.0}% of fio write (to the last ack, {put_s:.1} s); blocks on NVMe by the time demotion drained: {:.3} GB/s = {:.0}% of fio write ({drained_s:.1} s)",
        gb(put_bw),
        100.0 * put_bw / fio_w,
        gb(disk_bw),
        100.0 * disk_bw / fio_w
    );
    println!(
        "same-run put path without a disk (no spill tier, DRAM holding every block): {:.3} GB/s; the binding limit is min(fio, that) = {:.3} GB/s; put throughput = {:.0}% of it",
        gb(ceiling),
        gb(fio_w.min(ceiling)),
        100.0 * put_bw / fio_w.min(ceiling)
    );
    Ok(())
}

/// Put throughput of the same client and batches into a daemon with no spill tier and DRAM
/// for every block: what the put path itself can do on this machine.
fn put_ceiling(
    a: &BackpressureArgs,
    bs: u64,
    spec: &NamespaceSpec,
    buf: &[u8],
) -> anyhow::Result<f64> {
    let bytes = (1u64 << 30).min(parse_size(&a.size)?);
    let cfg = a.dir.join("ceiling.toml");
    let slab = bs.next_power_of_two().max(2 << 20);
    std::fs::write(
        &cfg,
        format!(
            "dram = {}
slab_size = {slab}
pin = false
",
            bytes + (64 << 20)
        ),
    )?;
    let (d, mut c, _) = crate::spill::serve(&a.dir, &cfg)?;
    let ns = c.register(spec)?.ns;
    let n = bytes / bs;
    let t = Instant::now();
    for start in (0..n).step_by(a.batch) {
        let keys: Vec<Key> = (start..(start + a.batch as u64).min(n)).map(key).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|_| buf).collect();
        c.put(ns, &keys, &refs)?;
    }
    let bw = (n * bs) as f64 / t.elapsed().as_secs_f64();
    drop(c);
    drop(d);
    Ok(bw)
}
