//! `kvnode bench gpu`: daemon-driven offload and onload GB/s per page size, next to plain pinned
//! cuMemcpy of the same size measured in the same run, on the same GPU.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvnode_client::Client;
use kvnode_gpu::mem::{DeviceBuffer, PinnedHost, pinned_copy_bandwidth};
use kvnode_proto::client::PutStatus;
use kvnode_proto::gpu::{GpuLayout, GpuObject, OnloadStatus};
use kvnode_proto::size::{ByteSize, parse_size};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::args::GpuBenchArgs;

fn key(size: u64, i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&size.to_be_bytes());
    d[8..16].copy_from_slice(&i.to_be_bytes());
    d[31] = 0x6b;
    Key::page(Digest(d))
}

/// Waits until the daemon's arena is fully registered with CUDA.
fn wait_registered(c: &mut Client, limit: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let s = c.stats()?;
        let cap = s.tiers.first().map_or(0, |t| t.capacity_bytes);
        if s.gpu.driver.starts_with("no CUDA driver") {
            bail!("the daemon reports: {}", s.gpu.driver);
        }
        if s.gpu.driver.starts_with("ready") && s.gpu.registered_bytes >= cap {
            println!(
                "daemon arena registered with CUDA: {} (status: {}), waited {:.1}s",
                ByteSize(s.gpu.registered_bytes),
                s.gpu.driver,
                t.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if t.elapsed() > limit {
            bail!(
                "arena registration not finished after {limit:?}: {} registered, status {}",
                ByteSize(s.gpu.registered_bytes),
                s.gpu.driver
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

struct Row {
    page: u64,
    offload: f64,
    d2h: f64,
    onload: f64,
    h2d: f64,
}

fn one_size(a: &GpuBenchArgs, page: u64, buf_bytes: u64, host: &PinnedHost) -> anyhow::Result<Row> {
    let pages = (buf_bytes / page).max(1);
    let dev = DeviceBuffer::alloc(a.device, pages * page)?;
    dev.fill(0x5a)?;
    let mut c = Client::connect(a.socket.path()).context("connecting to the daemon")?;
    let ns = c
        .register(&NamespaceSpec {
            model: format!("bench-gpu-{}", ByteSize(page)),
            page_size: 64,
            segments: vec![page],
            ..NamespaceSpec::default()
        })?
        .ns;
    let layout = GpuLayout {
        base: 0,
        page_stride: page,
        pages,
        objects: vec![GpuObject {
            offset: 0,
            size: page,
        }],
    };
    let buf = c.attach_gpu(&dev.ipc_handle()?, a.device, pages * page, layout)?;
    let batch = (parse_size(&a.batch_bytes)? / page).clamp(1, pages) as usize;
    let secs = Duration::from_secs_f64(a.duration);
    // Offload: fresh keys each request, so every page is copied and committed.
    let (mut n, mut bytes) = (0u64, 0u64);
    let t = Instant::now();
    while t.elapsed() < secs {
        let ids: Vec<u64> = (0..batch as u64).map(|j| (n + j) % pages).collect();
        let ks: Vec<Key> = (0..batch as u64).map(|j| key(page, n + j)).collect();
        let r = c.offload(buf, ns, &ks, &ids)?;
        if let Some(bad) = r.iter().find(|s| **s != PutStatus::Stored) {
            bail!("offload of {} pages refused: {bad:?}", ks.len());
        }
        n += batch as u64;
        bytes += batch as u64 * page;
    }
    let offload = bytes as f64 / t.elapsed().as_secs_f64();
    // Onload: the last `pages` offloaded keys are resident; load them back repeatedly.
    let resident = n.min(pages);
    let first = n - resident;
    let (mut i, mut bytes) = (0u64, 0u64);
    let t = Instant::now();
    while t.elapsed() < secs {
        let ps: Vec<u64> = (0..batch as u64)
            .map(|j| first + (i + j) % resident)
            .collect();
        let ks: Vec<Key> = ps.iter().map(|&k| key(page, k)).collect();
        let ids: Vec<u64> = ps.iter().map(|&k| k % pages).collect();
        let r = c.onload(buf, ns, &ks, &ids)?;
        if let Some(bad) = r.iter().find(|s| **s != OnloadStatus::Loaded) {
            bail!("onload: {bad:?} (DRAM tier smaller than the {resident}-page working set?)");
        }
        i += batch as u64;
        bytes += batch as u64 * page;
    }
    let onload = bytes as f64 / t.elapsed().as_secs_f64();
    // Free this size's slabs for the next size's slot class.
    c.clear(Some(ns))?;
    let iters = ((offload.max(onload) * a.duration) / page as f64).max(16.0) as usize;
    let d2h = pinned_copy_bandwidth(&dev, host, page, iters, false)?;
    let h2d = pinned_copy_bandwidth(&dev, host, page, iters, true)?;
    Ok(Row {
        page,
        offload,
        d2h,
        onload,
        h2d,
    })
}

/// Runs the benchmark and prints one row per page size.
pub fn run(a: &GpuBenchArgs) -> anyhow::Result<()> {
    let mut c = Client::connect(a.socket.path()).context("connecting to the daemon")?;
    wait_registered(&mut c, Duration::from_secs(a.register_timeout))?;
    kvnode_gpu::driver::init()?;
    let buf_bytes = parse_size(&a.gpu_buffer)?;
    let _ = DeviceBuffer::alloc(a.device, 1 << 20)?; // binds the context for the pinned buffer
    let host = PinnedHost::alloc(buf_bytes as usize)?;
    println!(
        "kvnode bench gpu: device {} batch {} per request, {}s per op, GPU buffer {}",
        a.device,
        a.batch_bytes,
        a.duration,
        ByteSize(buf_bytes)
    );
    println!(
        "{:>8} {:>12} {:>14} {:>7} {:>12} {:>14} {:>7}",
        "page", "offload", "cuMemcpy D2H", "ratio", "onload", "cuMemcpy H2D", "ratio"
    );
    for s in &a.sizes {
        let page = parse_size(s).with_context(|| format!("--sizes {s}"))?;
        let r = one_size(a, page, buf_bytes, &host)?;
        println!(
            "{:>8} {:>9.2} GB/s {:>9.2} GB/s {:>6.1}% {:>7.2} GB/s {:>9.2} GB/s {:>6.1}%",
            ByteSize(r.page).to_string(),
            r.offload / 1e9,
            r.d2h / 1e9,
            r.offload / r.d2h * 100.0,
            r.onload / 1e9,
            r.h2d / 1e9,
            r.onload / r.h2d * 100.0
        );
        if a.json {
            println!(
                "{}",
                serde_json::json!({"page": r.page, "offload_gbps": r.offload / 1e9, "d2h_gbps": r.d2h / 1e9,
                    "onload_gbps": r.onload / 1e9, "h2d_gbps": r.h2d / 1e9})
            );
        }
    }
    Ok(())
}
