//! Layer-wise onloads over the fake device: layer 0 of every page lands before any page's
//! layer 1, the ticket's progress reports each layer as its fence completes, a run of pages is
//! one pitched copy per layer object, and a cancel stops at a layer boundary.
//! Run: `cargo test --release -p kvnode-gpu --test layered_copies`.

use std::time::Duration;

use kvnode_gpu::fake::{FakeBackend, FakeDevice};
use kvnode_gpu::{DeviceWorker, Dir, HostPieces, WorkerConfig, layer_ops};
use kvnode_proto::gpu::{GpuLayout, GpuObject};

/// `[layer][K|V][page][chunk]` with `layers` layers.
fn layer_first(pages: u64, layers: u64, chunk: u64) -> GpuLayout {
    GpuLayout {
        base: 0,
        page_stride: chunk,
        pages,
        objects: (0..2 * layers)
            .map(|j| GpuObject {
                offset: j * pages * chunk,
                size: chunk,
            })
            .collect(),
    }
}

fn worker(dev: &FakeDevice) -> DeviceWorker {
    let d = dev.clone();
    // Large batches: only the layer fences (fence_every_unit) split the job.
    DeviceWorker::spawn(
        0,
        WorkerConfig {
            batch_bytes: 1 << 30,
            max_inflight: 2,
        },
        move || Ok(FakeBackend::new(d)),
    )
}

/// Device bytes of layer `l` (K and V) of page `p`.
fn layer_of(b: &[u8], l: u64, p: u64, pages: u64, chunk: u64) -> Vec<u8> {
    let at = |j: u64| ((j * pages + p) * chunk) as usize;
    let (k, v) = (at(2 * l), at(2 * l + 1));
    [&b[k..k + chunk as usize], &b[v..v + chunk as usize]].concat()
}

async fn progress_reaches(rx: &mut tokio::sync::watch::Receiver<usize>, n: usize) {
    tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|&d| d >= n))
        .await
        .expect("progress stalled")
        .expect("job ended first");
}

#[tokio::test]
async fn layers_land_in_model_order_and_progress_reports_each() {
    let (pages, layers, chunk) = (6u64, 3u64, 256u64);
    let l = layer_first(pages, layers, chunk);
    let len = 2 * layers * pages * chunk;
    let pb = l.page_bytes() as usize;
    let dev = FakeDevice::default();
    let h = dev.alloc(len as usize, 0);
    let wk = worker(&dev);
    let m = wk.open(h, len).await.unwrap();
    // Blocks of pages 1..=4 in equally spaced slots (one spare block between them).
    let mut host: Vec<u8> = (0..8 * pb).map(|i| (i % 251) as u8 + 1).collect();
    let base = host.as_mut_ptr() as usize;
    let rows: Vec<(usize, u64)> = (0..4).map(|i| (base + 2 * i * pb, 1 + i as u64)).collect();
    let plan = layer_ops(&l, m, &rows, layers as u32, HostPieces::NONE).unwrap();
    // K and V of a layer: one pitched copy each over the 4 pages.
    assert_eq!(plan.layer_ends, vec![2, 4, 6]);
    assert!(
        plan.ops
            .iter()
            .all(|o| o.rows == 4 && o.host_pitch == 2 * pb as u64)
    );
    dev.gate();
    // SAFETY: `host` outlives the wait and nothing else touches it meanwhile.
    let t = unsafe { wk.submit_with(Dir::HostToDevice, m, plan.ops.clone(), true) }.unwrap();
    let mut rx = t.progress();
    for (li, &end) in plan.layer_ends.iter().enumerate() {
        dev.release(1);
        progress_reaches(&mut rx, end).await;
        let b = dev.bytes(&h);
        for (i, &(_, p)) in rows.iter().enumerate() {
            for layer in 0..layers {
                let got = layer_of(&b, layer, p, pages, chunk);
                let blk = &host[2 * i * pb..2 * i * pb + pb];
                let want = &blk[(2 * layer * chunk) as usize..(2 * (layer + 1) * chunk) as usize];
                if layer as usize <= li {
                    assert_eq!(got, want, "layer {layer} of page {p} after layer {li}");
                } else {
                    assert!(
                        got.iter().all(|&x| x == 0),
                        "layer {layer} of page {p} landed early"
                    );
                }
            }
        }
        // Pages not in the onload are never written.
        assert!(layer_of(&b, 0, 0, pages, chunk).iter().all(|&x| x == 0));
        assert!(layer_of(&b, 0, 5, pages, chunk).iter().all(|&x| x == 0));
    }
    dev.ungate();
    assert_eq!(t.wait().await.unwrap(), plan.ops.len());
    assert_eq!(*rx.borrow(), plan.ops.len());
}

#[tokio::test]
async fn a_cancelled_layered_onload_stops_at_a_layer_boundary() {
    let (pages, layers, chunk) = (4u64, 4u64, 128u64);
    let l = layer_first(pages, layers, chunk);
    let len = 2 * layers * pages * chunk;
    let pb = l.page_bytes() as usize;
    let dev = FakeDevice::default();
    let h = dev.alloc(len as usize, 0);
    let wk = worker(&dev);
    let m = wk.open(h, len).await.unwrap();
    let mut host = vec![0x5Au8; pages as usize * pb];
    let base = host.as_mut_ptr() as usize;
    // Scattered slots: several copies per layer.
    let rows: Vec<(usize, u64)> = (0..pages)
        .map(|p| (base + ((p * 3) % pages) as usize * pb, p))
        .collect();
    let plan = layer_ops(&l, m, &rows, layers as u32, HostPieces::NONE).unwrap();
    dev.gate();
    // SAFETY: `host` outlives the wait.
    let t = unsafe { wk.submit_with(Dir::HostToDevice, m, plan.ops.clone(), true) }.unwrap();
    let mut rx = t.progress();
    dev.release(1);
    progress_reaches(&mut rx, plan.layer_ends[0]).await;
    t.cancel();
    dev.ungate();
    let done = t.wait().await.unwrap();
    // Layers in flight when the cancel came (at most max_inflight = 2 after layer 0) complete;
    // nothing after them is issued, and the count is a layer boundary.
    let landed = plan
        .layer_ends
        .iter()
        .position(|&e| e == done)
        .expect("a cancel stops at a layer boundary")
        + 1;
    assert!((2..=3).contains(&landed), "{landed} layers landed");
    assert_eq!(*rx.borrow(), done);
    let b = dev.bytes(&h);
    for p in 0..pages {
        for layer in 0..layers as usize {
            let got = layer_of(&b, layer as u64, p, pages, chunk);
            let want = if layer < landed { 0x5A } else { 0 };
            assert!(got.iter().all(|&x| x == want), "layer {layer} page {p}");
        }
    }
}
