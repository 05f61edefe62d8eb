//! Pins the copy thread's contract over the fake device: copies land, a cancel's reply is a
//! fence (nothing is written after it), mappings close only after their copies, and bad
//! handles or lengths are refused. Run: `cargo test --release -p kvnode-gpu --test fenced_copies`.

use std::time::Duration;

use kvnode_gpu::fake::{FakeBackend, FakeDevice};
use kvnode_gpu::{CopyOp, DeviceWorker, Dir, GpuError, WorkerConfig};
use kvnode_proto::gpu::LayoutError;

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
        .map(|p| CopyOp {
            dev: mapping + (p * PAGE) as u64,
            host: host.as_mut_ptr() as usize + p * PAGE,
            len: PAGE as u64,
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
