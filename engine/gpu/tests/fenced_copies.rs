//! Pins the copy thread's contract over the fake device: copies land, a cancel's reply is a
//! fence (nothing is written after it), mappings close only after their copies, bad handles or
//! lengths are refused, and strided (2D) copies move exactly their rows, one copy per
//! layer-first page, with a cancel counting whole pages. Run: `cargo test --release -p kvnode-gpu --test fenced_copies`.

use std::time::Duration;

use kvnode_gpu::fake::{FakeBackend, FakeDevice};
use kvnode_gpu::{CopyOp, DeviceWorker, Dir, GpuError, WorkerConfig, page_ops};
use kvnode_proto::gpu::{GpuLayout, GpuObject, LayoutError};

const PAGE: usize = 4096;

fn worker(dev: &FakeDevice, batch_bytes: u64, max_inflight: usize) -> DeviceWorker {
    let d = dev.clone();
    DeviceWorker::spawn(
        0,
        WorkerConfig {
            batch_bytes,
            max_inflight,
        },
        move || Ok(FakeBackend::new(d)),
    )
}

fn ops(mapping: u64, host: &mut [u8], pages: usize) -> Vec<CopyOp> {
    (0..pages)
        .map(|p| {
            CopyOp::linear(
                mapping + (p * PAGE) as u64,
                host.as_mut_ptr() as usize + p * PAGE,
                PAGE as u64,
            )
        })
        .collect()
}

async fn wait_blocked(dev: &FakeDevice) {
    for _ in 0..2000 {
        if dev.blocked() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the copy thread never reached a fence");
}

#[tokio::test]
async fn offloaded_pages_round_trip_through_the_device() {
    let dev = FakeDevice::default();
    let h = dev.alloc(8 * PAGE, 0);
    dev.write(&h, |b| {
        b.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i % 251) as u8);
    });
    let w = worker(&dev, 2 * PAGE as u64, 2);
    let m = w.open(h, 8 * PAGE as u64).await.unwrap();
    let mut host = vec![0u8; 8 * PAGE];
    // SAFETY: `host` outlives the wait and nothing else touches it meanwhile.
    let t = unsafe { w.submit(Dir::DeviceToHost, m, ops(m, &mut host, 8)) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), 8);
    assert_eq!(host, dev.bytes(&h));
    dev.write(&h, |b| b.fill(0));
    // SAFETY: as above.
    let t = unsafe { w.submit(Dir::HostToDevice, m, ops(m, &mut host, 8)) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), 8);
    assert_eq!(host, dev.bytes(&h));
}

#[tokio::test]
async fn cancelled_onload_never_writes_after_its_reply() {
    let dev = FakeDevice::default();
    let h = dev.alloc(8 * PAGE, 0);
    let mut host = vec![0xAB; 8 * PAGE];
    let w = worker(&dev, PAGE as u64, 2);
    let m = w.open(h, 8 * PAGE as u64).await.unwrap();
    dev.gate();
    // SAFETY: `host` outlives the wait.
    let t = unsafe { w.submit(Dir::HostToDevice, m, ops(m, &mut host, 8)) }.unwrap();
    wait_blocked(&dev).await;
    t.cancel();
    dev.ungate();
    let done = t.wait().await.unwrap();
    assert_eq!(done, 2, "two batches were in flight when cancel arrived");
    let copies = dev.host_to_device_copies();
    assert_eq!(copies, 2);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        dev.host_to_device_copies(),
        copies,
        "a write happened after the cancel returned"
    );
    let b = dev.bytes(&h);
    assert!(b[..2 * PAGE].iter().all(|&x| x == 0xAB));
    assert!(b[2 * PAGE..].iter().all(|&x| x == 0));
}

#[tokio::test]
async fn mapping_closes_only_after_its_in_flight_copies() {
    let dev = FakeDevice::default();
    let h = dev.alloc(4 * PAGE, 7);
    let mut host = vec![0u8; 4 * PAGE];
    let w = std::sync::Arc::new(worker(&dev, PAGE as u64, 1));
    let m = w.open(h, 4 * PAGE as u64).await.unwrap();
    dev.gate();
    // SAFETY: `host` outlives the wait.
    let t = unsafe { w.submit(Dir::DeviceToHost, m, ops(m, &mut host, 4)) }.unwrap();
    wait_blocked(&dev).await;
    let w2 = std::sync::Arc::clone(&w);
    let close = tokio::spawn(async move { w2.close(m).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(dev.mappings(), (1, 0), "closed while a copy was in flight");
    dev.ungate();
    assert_eq!(t.wait().await.unwrap(), 4);
    close.await.unwrap().unwrap();
    assert_eq!(dev.mappings(), (0, 1));
    assert!(host.iter().all(|&x| x == 7));
}

#[tokio::test]
async fn length_beyond_the_allocation_or_unknown_handle_is_refused() {
    let dev = FakeDevice::default();
    let h = dev.alloc(4 * PAGE, 0);
    let w = worker(&dev, PAGE as u64, 1);
    assert_eq!(
        w.open(h, 4 * PAGE as u64 + 16).await,
        Err(GpuError::Layout(LayoutError::BeyondAllocation {
            len: 4 * PAGE as u64 + 16,
            alloc: 4 * PAGE as u64
        }))
    );
    assert_eq!(dev.mappings(), (0, 1), "the refused mapping was not closed");
    assert!(matches!(
        w.open([9; 64], 16).await,
        Err(GpuError::Cuda { .. })
    ));
}

#[tokio::test]
async fn a_backend_that_cannot_start_answers_every_request_with_its_error() {
    let w = DeviceWorker::spawn::<FakeBackend>(3, WorkerConfig::default(), || {
        Err(GpuError::NoDevice {
            device: 3,
            count: 1,
        })
    });
    let e = w.open([1; 64], 16).await.unwrap_err();
    assert_eq!(
        e,
        GpuError::NoDevice {
            device: 3,
            count: 1
        }
    );
    assert!(e.to_string().contains("CUDA_VISIBLE_DEVICES"));
}

/// A layer-first buffer: `objs` objects (layers x K/V) of `w` bytes per page, `pages` pages.
fn layer_first(pages: u64, objs: u64, w: u64) -> GpuLayout {
    GpuLayout {
        base: 0,
        page_stride: w,
        pages,
        objects: (0..objs)
            .map(|j| GpuObject {
                offset: j * pages * w,
                size: w,
            })
            .collect(),
    }
}

#[tokio::test]
async fn a_strided_copy_moves_exactly_the_strided_bytes() {
    // 6 rows of 48 B, 160 B apart, starting 32 B into the allocation.
    let (rows, width, pitch, at) = (6u64, 48u64, 160u64, 32u64);
    let dev = FakeDevice::default();
    let h = dev.alloc(1024, 0);
    dev.write(&h, |b| {
        b.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i % 251) as u8);
    });
    let orig = dev.bytes(&h);
    let w = worker(&dev, 1 << 20, 2);
    let m = w.open(h, 1024).await.unwrap();
    let mut host = vec![0u8; (rows * width) as usize];
    let op = CopyOp::strided(m + at, host.as_mut_ptr() as usize, width, rows, pitch);
    assert_eq!((op.rows, op.bytes()), (rows, rows * width));
    // SAFETY: `host` outlives the wait and nothing else touches it meanwhile.
    let t = unsafe { w.submit(Dir::DeviceToHost, m, vec![op]) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), 1);
    let gathered: Vec<u8> = (0..rows)
        .flat_map(|r| {
            let s = (at + r * pitch) as usize;
            orig[s..s + width as usize].to_vec()
        })
        .collect();
    assert_eq!(host, gathered, "offload gathers the rows back to back");
    assert_eq!(dev.device_to_host_copies(), 1, "one copy, not one per row");
    // Scatter a different pattern back: only the rows change, the gaps keep their bytes.
    for x in &mut host {
        *x = !*x;
    }
    // SAFETY: as above.
    let t = unsafe { w.submit(Dir::HostToDevice, m, vec![op]) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), 1);
    assert_eq!(dev.host_to_device_copies(), 1);
    let after = dev.bytes(&h);
    for (i, (&a, &o)) in after.iter().zip(&orig).enumerate() {
        let i = i as u64;
        let row = i >= at && (i - at) % pitch < width && (i - at) / pitch < rows;
        let want = if row {
            host[((i - at) / pitch * width + (i - at) % pitch) as usize]
        } else {
            o
        };
        assert_eq!(a, want, "byte {i} (in a row: {row})");
    }
}

#[tokio::test]
async fn layer_first_pages_round_trip_as_one_strided_copy_each() {
    let (pages, objs, w) = (8u64, 6u64, 64u64);
    let l = layer_first(pages, objs, w);
    let len = pages * objs * w;
    l.validate(len).unwrap();
    let dev = FakeDevice::default();
    let h = dev.alloc(len as usize, 0);
    dev.write(&h, |b| {
        b.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i % 253) as u8);
    });
    let orig = dev.bytes(&h);
    let wk = worker(&dev, 1 << 20, 2);
    let m = wk.open(h, len).await.unwrap();
    let pb = l.page_bytes() as usize;
    let mut host = vec![0u8; pages as usize * pb];
    let mut ops = Vec::new();
    // Page p goes to block slot (p + 3) % pages: permuted, like slots in the arena.
    for p in 0..pages {
        let slot = ((p + 3) % pages) as usize;
        page_ops(&l, m, host.as_mut_ptr() as usize + slot * pb, p, &mut ops);
    }
    assert_eq!(ops.len(), pages as usize);
    assert!(
        ops.iter()
            .all(|o| o.rows == objs && o.dev_pitch == pages * w)
    );
    // SAFETY: `host` outlives the wait.
    let t = unsafe { wk.submit(Dir::DeviceToHost, m, ops.clone()) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), pages as usize);
    for p in 0..pages {
        let slot = ((p + 3) % pages) as usize;
        let want: Vec<u8> = l
            .extents(p)
            .flat_map(|(d, _, s)| orig[d as usize..(d + s) as usize].to_vec())
            .collect();
        assert_eq!(host[slot * pb..(slot + 1) * pb], want[..], "page {p}");
    }
    dev.write(&h, |b| b.fill(0));
    // SAFETY: as above.
    let t = unsafe { wk.submit(Dir::HostToDevice, m, ops) }.unwrap();
    assert_eq!(t.wait().await.unwrap(), pages as usize);
    assert_eq!(dev.bytes(&h), orig);
}

#[tokio::test]
async fn a_cancelled_strided_onload_counts_whole_pages_and_writes_no_other() {
    let (pages, objs, w) = (8u64, 4u64, 256u64);
    let l = layer_first(pages, objs, w);
    let len = pages * objs * w;
    let dev = FakeDevice::default();
    let h = dev.alloc(len as usize, 0);
    let pb = l.page_bytes() as usize;
    let mut host = vec![0xCDu8; pages as usize * pb];
    // One page (1 KiB) per batch, two batches in flight.
    let wk = worker(&dev, pb as u64, 2);
    let m = wk.open(h, len).await.unwrap();
    let mut ops = Vec::new();
    for p in 0..pages {
        page_ops(
            &l,
            m,
            host.as_mut_ptr() as usize + p as usize * pb,
            p,
            &mut ops,
        );
    }
    dev.gate();
    // SAFETY: `host` outlives the wait.
    let t = unsafe { wk.submit(Dir::HostToDevice, m, ops) }.unwrap();
    wait_blocked(&dev).await;
    t.cancel();
    dev.ungate();
    let done = t.wait().await.unwrap();
    assert_eq!(done, 2, "two pages were in flight when cancel arrived");
    tokio::time::sleep(Duration::from_millis(30)).await;
    let b = dev.bytes(&h);
    for p in 0..pages {
        let written = l
            .extents(p)
            .all(|(d, _, s)| b[d as usize..(d + s) as usize].iter().all(|&x| x == 0xCD));
        let untouched = l
            .extents(p)
            .all(|(d, _, s)| b[d as usize..(d + s) as usize].iter().all(|&x| x == 0));
        if p < done as u64 {
            assert!(written, "page {p} counted complete but not whole");
        } else {
            assert!(untouched, "page {p} written after its cancel");
        }
    }
}

#[tokio::test]
async fn a_cancel_never_splits_a_page_of_several_copies() {
    // Irregular objects (64 B then 32 B, apart): two copies per page. Batches of 1 byte would
    // fence after every copy; fences go only after a page's last copy.
    let l = GpuLayout {
        base: 0,
        page_stride: 128,
        pages: 8,
        objects: vec![
            GpuObject {
                offset: 0,
                size: 64,
            },
            GpuObject {
                offset: 1024,
                size: 32,
            },
        ],
    };
    assert_eq!(l.strided(), None);
    let len = 1024 + 8 * 128;
    let dev = FakeDevice::default();
    let h = dev.alloc(len, 0);
    let pb = l.page_bytes() as usize;
    let mut host = vec![0xEEu8; 8 * pb];
    let wk = worker(&dev, 1, 1);
    let m = wk.open(h, len as u64).await.unwrap();
    let mut ops = Vec::new();
    for p in 0..8 {
        page_ops(
            &l,
            m,
            host.as_mut_ptr() as usize + p as usize * pb,
            p,
            &mut ops,
        );
    }
    assert_eq!(ops.len(), 16);
    dev.gate();
    // SAFETY: `host` outlives the wait.
    let t = unsafe { wk.submit(Dir::HostToDevice, m, ops) }.unwrap();
    wait_blocked(&dev).await;
    t.cancel();
    dev.ungate();
    let done = t.wait().await.unwrap();
    assert_eq!(done, 2, "one page (two copies) was in flight");
    let b = dev.bytes(&h);
    for p in 0..8u64 {
        let want = if p == 0 { 0xEE } else { 0 };
        for (d, _, s) in l.extents(p) {
            assert!(
                b[d as usize..(d + s) as usize].iter().all(|&x| x == want),
                "page {p}"
            );
        }
    }
}
