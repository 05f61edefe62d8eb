//! Layer-wise onload through a real daemon on the fake GPU (test-seams build with
//! `KVNODE_TEST_FAKE_GPU`: the IPC handle names a file that stands for GPU memory, each fence
//! waits a delay). Pages are offloaded, the "GPU" is wiped, and a layer-wise `OnloadAsync`
//! lands layer 0 of every page before any layer 1: after `OnloadLayerWait(l)` layers 0..=l are
//! in place and layer l+1 not yet. Bad layer requests get typed errors and the daemon serves on.
//! Run: `cargo test --release -p kvnode-e2e --test gpu_layered`.

use std::path::Path;

use kvnode_client::ClientError;
use kvnode_e2e::{Daemon, key, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::client::{ErrorCode, PutStatus};
use kvnode_proto::gpu::{GpuLayout, GpuObject, OnloadStatus};

const PAGES: u64 = 8;
const LAYERS: u64 = 3;
const CHUNK: u64 = 256;
/// Each fence of the fake device waits this long: a layer lands well after the previous one.
const FENCE_DELAY_US: &str = "300000";

/// `[layer][K|V][page][chunk]`.
fn layout(layers: u64) -> GpuLayout {
    GpuLayout {
        base: 0,
        page_stride: CHUNK,
        pages: PAGES,
        objects: (0..2 * layers)
            .map(|j| GpuObject {
                offset: j * PAGES * CHUNK,
                size: CHUNK,
            })
            .collect(),
    }
}

fn handle(path: &Path) -> [u8; 64] {
    let p = path.to_str().expect("utf-8 path").as_bytes();
    assert!(
        p.len() < 64,
        "fake GPU file path too long: {}",
        path.display()
    );
    let mut h = [0u8; 64];
    h[..p.len()].copy_from_slice(p);
    h
}

/// Device bytes of layer `l` (K then V) of page `p`.
fn layer_of(b: &[u8], l: u64, p: u64) -> Vec<u8> {
    let at = |j: u64| ((j * PAGES + p) * CHUNK) as usize;
    let (k, v) = (at(2 * l), at(2 * l + 1));
    [&b[k..k + CHUNK as usize], &b[v..v + CHUNK as usize]].concat()
}

fn server_error<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (ErrorCode, String) {
    match r {
        Err(ClientError::Server { code, message }) => (code, message),
        other => panic!("expected a daemon error, got {other:?}"),
    }
}

#[test]
fn a_layer_wise_onload_lands_layer_by_layer_and_reports_each_layer() {
    let dir = temp_dir("gpulayers");
    let file = dir.join("gpu.bin");
    let len = 2 * LAYERS * PAGES * CHUNK;
    let orig: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
    std::fs::write(&file, &orig).unwrap();
    let d = Daemon::start_env(
        &[("KVNODE_TEST_FAKE_GPU", FENCE_DELAY_US)],
        &["--dram", "64MiB", "--no-pin", "--no-populate"],
    );
    let mut c = d.client();
    let l = layout(LAYERS);
    let ns = c.register(&spec("gpu-layers", l.page_bytes())).unwrap().ns;
    let buf = c.attach_gpu(&handle(&file), 0, len, l.clone()).unwrap();
    assert_eq!(buf.page_bytes, 2 * LAYERS * CHUNK);
    // Pages 0..4 become blocks; the "GPU" is then wiped and they come back into pages 4..8.
    let keys: Vec<Key> = (0..4).map(key).collect();
    let stored = c.offload(buf, ns, &keys, &[0, 1, 2, 3]).unwrap();
    assert!(stored.iter().all(|s| *s == PutStatus::Stored), "{stored:?}");
    std::fs::write(&file, vec![0u8; len as usize]).unwrap();

    let t = c
        .onload_layers_async(buf, ns, &keys, &[4, 5, 6, 7], LAYERS as u32)
        .unwrap();
    for layer in 0..LAYERS {
        assert!(
            c.onload_layer_wait(t, layer as u32).unwrap(),
            "layer {layer}"
        );
        let now = std::fs::read(&file).unwrap();
        for (src, dst) in (0..4).zip(4..8) {
            for x in 0..LAYERS {
                let got = layer_of(&now, x, dst);
                if x <= layer {
                    assert_eq!(got, layer_of(&orig, x, src), "layer {x} of page {dst}");
                } else {
                    assert!(
                        got.iter().all(|&b| b == 0),
                        "layer {x} of page {dst} before layer {layer}'s wait returned... and it landed early"
                    );
                }
            }
        }
        // Waiting again for a landed layer answers at once.
        assert!(c.onload_layer_wait(t, 0).unwrap());
    }
    let res = c.onload_wait(t).unwrap();
    assert_eq!(res, vec![OnloadStatus::Loaded; 4]);
    let now = std::fs::read(&file).unwrap();
    for p in 0..4 {
        assert!(
            layer_of(&now, 0, p).iter().all(|&b| b == 0),
            "page {p} was never onloaded"
        );
    }

    // Bad requests: typed errors, the connection and the daemon keep serving.
    let (code, msg) = server_error(c.onload_layers_async(buf, ns, &keys, &[4, 5, 6, 7], 5));
    assert_eq!(code, ErrorCode::Invalid);
    assert!(msg.contains("layers"), "{msg}");
    let (code, _) = server_error(c.onload_layer_wait(t, 0));
    assert_eq!(
        code,
        ErrorCode::NotOwned,
        "a finished onload's ticket is gone"
    );
    let plain = c.onload_async(buf, ns, &keys, &[4, 5, 6, 7]).unwrap();
    let (code, msg) = server_error(c.onload_layer_wait(plain, 0));
    assert_eq!(code, ErrorCode::Invalid);
    assert!(msg.contains("not layer-wise"), "{msg}");
    let layered = c
        .onload_layers_async(buf, ns, &keys, &[4, 5, 6, 7], LAYERS as u32)
        .unwrap();
    let (code, msg) = server_error(c.onload_layer_wait(layered, LAYERS as u32));
    assert_eq!(code, ErrorCode::Invalid);
    assert!(msg.contains("out of range"), "{msg}");
    // A cancelled layer-wise onload: a wait for a layer it never reached says so.
    let cancelled = c.onload_cancel(layered).unwrap();
    assert!(
        cancelled
            .iter()
            .all(|s| matches!(s, OnloadStatus::Cancelled | OnloadStatus::Loaded))
    );
    assert_eq!(c.onload_wait(plain).unwrap(), vec![OnloadStatus::Loaded; 4]);
    assert!(c.stats().is_ok(), "daemon stopped serving");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tickets_are_per_connection_and_a_cancel_after_layer_0_leaves_the_pages_cancelled() {
    // More layers than the copy thread keeps in flight (4), so a cancel stops real work.
    const L: u64 = 8;
    let dir = temp_dir("gpulayers-stop");
    let file = dir.join("gpu.bin");
    let len = 2 * L * PAGES * CHUNK;
    // Every chunk of page p holds p + 1.
    let fill: Vec<u8> = (0..len).map(|i| ((i / CHUNK) % PAGES) as u8 + 1).collect();
    std::fs::write(&file, &fill).unwrap();
    let d = Daemon::start_env(
        &[("KVNODE_TEST_FAKE_GPU", FENCE_DELAY_US)],
        &["--dram", "64MiB", "--no-pin", "--no-populate"],
    );
    let l = layout(L);
    // Two connections: one starts and cancels, the other cannot see its ticket.
    let mut c = d.client();
    let ns = c.register(&spec("gpu-layers", l.page_bytes())).unwrap().ns;
    let buf = c.attach_gpu(&handle(&file), 0, len, l).unwrap();
    let keys: Vec<Key> = (0..2).map(key).collect();
    c.offload(buf, ns, &keys, &[0, 1]).unwrap();
    std::fs::write(&file, vec![0u8; len as usize]).unwrap();
    let t = c
        .onload_layers_async(buf, ns, &keys, &[2, 3], L as u32)
        .unwrap();
    let mut other = d.client();
    let (code, _) = server_error(other.onload_layer_wait(t, 0));
    assert_eq!(code, ErrorCode::NotOwned, "tickets are per connection");
    // Cancel after layer 0: the layers in flight finish, the last layer is never reached, so
    // no page is whole.
    assert!(c.onload_layer_wait(t, 0).unwrap());
    let res = c.onload_cancel(t).unwrap();
    assert!(res.iter().all(|s| *s == OnloadStatus::Cancelled), "{res:?}");
    let now = std::fs::read(&file).unwrap();
    let chunk = |j: u64, p: u64| {
        let at = ((j * PAGES + p) * CHUNK) as usize;
        now[at..at + CHUNK as usize].to_vec()
    };
    // Layer 0 (objects 0 and 1) of pages 2, 3 holds pages 0, 1's bytes; the last layer nothing.
    for (dst, src) in [(2u64, 0u8), (3, 1)] {
        assert!(
            chunk(0, dst)
                .iter()
                .chain(&chunk(1, dst))
                .all(|&b| b == src + 1)
        );
        assert!(
            chunk(2 * L - 1, dst).iter().all(|&b| b == 0),
            "page {dst}'s last layer landed"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
