//! GPU onload of NVMe-resident pages through the real API server (a Unix socket, real
//! frames) with the fake GPU in the same process and a real spill file under /var/tmp: an
//! onload larger than the DRAM tier can lease is refused as `TooLarge` with the leading pages
//! that can be, and onloading those parts in order loads every page byte-exactly.
//! Run: `cargo test --release -p kvnode-engine --lib api::gpu_tests`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use kvnode_gpu::fake::{FakeBackend, FakeDevice};
use kvnode_gpu::{DeviceWorker, GpuHub, WorkerConfig};
use kvnode_proto::client::{Op, PutStatus, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, decode_header, encode_frame};
use kvnode_proto::gpu::{AttachGpu, GpuLayout, GpuObject, OnloadStatus, PageMove};
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::config::EngineConfig;
use crate::engine::Engine;
use crate::nvme::config::{SpillDirSetting, SpillSettings};

const PAGE: u64 = 256 << 10;
/// 12 MiB: one and a half times the 8 MiB DRAM tier, three times its hold limit.
const PAGES: u64 = 48;

fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0x6b;
    Key::page(Digest(d))
}

fn page(i: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|j| (i as u8).wrapping_mul(7) ^ (j as u8))
        .collect()
}

/// A blocking client speaking raw frames (the arena descriptor of `HelloOk` is dropped).
struct Raw(UnixStream, u64);

impl Raw {
    fn call(&mut self, op: Op, payload: &[&[u8]]) -> Reply {
        self.1 += 1;
        let total: u64 = payload.iter().map(|p| p.len() as u64).sum();
        let f = encode_frame(&Request { id: self.1, op }, total).unwrap();
        self.0.write_all(&f).unwrap();
        for p in payload {
            self.0.write_all(p).unwrap();
        }
        let mut pre = [0u8; PREFIX_LEN];
        self.0.read_exact(&mut pre).unwrap();
        let p = FramePrefix::decode(pre).unwrap();
        let mut h = vec![0u8; p.header_len as usize];
        self.0.read_exact(&mut h).unwrap();
        let mut rest = vec![0u8; p.payload_len as usize];
        self.0.read_exact(&mut rest).unwrap();
        decode_header::<Response>(&h).unwrap().reply
    }

    fn onload(&mut self, ns: u32, from: u64, n: u64) -> Reply {
        self.call(
            Op::Onload(PageMove {
                ns,
                keys: (from..from + n).map(key).collect(),
                page_ids: (from..from + n).collect(),
                buffer: 0,
                layers: 0,
                hint: None,
                deadline_ms: None,
            }),
            &[],
        )
    }
}

/// A running engine with the fake GPU, serving on its socket until dropped.
struct Server {
    engine: Arc<Engine>,
    dev: FakeDevice,
    socket: std::path::PathBuf,
    dir: std::path::PathBuf,
    stop_tx: tokio::sync::watch::Sender<bool>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_tx.send(true);
        drop(self.rt.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An engine with an 8 MiB DRAM tier over a real spill file, and the fake GPU.
fn start() -> Server {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvnode-gpu-tests-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = EngineConfig {
        socket: dir.join("kv.sock"),
        dram: 8 << 20,
        slab_size: Some(1 << 20),
        pin: false,
        populate: false,
        spill: SpillSettings {
            dirs: vec![SpillDirSetting {
                path: dir.join("spill"),
                size: 64 << 20,
            }],
            ..SpillSettings::default()
        },
        ..EngineConfig::default()
    };
    let dev = FakeDevice::default();
    let d = dev.clone();
    let hub = GpuHub::with_spawner(move |device| {
        let d = d.clone();
        Ok(DeviceWorker::spawn(
            device,
            WorkerConfig::default(),
            move || Ok(FakeBackend::new(d)),
        ))
    });
    let engine = Engine::start_with_gpu(config.clone(), hub).expect("engine");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let listener = {
        let _g = rt.enter();
        super::bind(&config.socket, 0o600, false).expect("bind")
    };
    rt.spawn(super::serve(Arc::clone(&engine), listener, stop.clone()));
    let _ = rt.block_on(async { engine.spawn_background(stop.clone()) });
    Server {
        engine,
        dev,
        socket: config.socket,
        dir,
        stop_tx,
        rt: Some(rt),
    }
}

/// Says hello, registers the namespace, puts every page (the head spills to NVMe) and
/// attaches a fake GPU buffer of `PAGES` pages; returns the namespace and buffer handle.
fn fill_and_attach(c: &mut Raw, dev: &FakeDevice) -> (u32, [u8; 64]) {
    let hello = c.call(
        Op::Hello {
            version: kvnode_proto::PROTOCOL_VERSION,
            client: "gpu-tests".into(),
        },
        &[],
    );
    assert!(matches!(hello, Reply::HelloOk { .. }), "{hello:?}");
    let Reply::Registered { ns, .. } = c.call(
        Op::Register {
            spec: NamespaceSpec {
                model: "gpu-tests".into(),
                page_size: 16,
                segments: vec![PAGE],
                ..NamespaceSpec::default()
            },
        },
        &[],
    ) else {
        panic!("register")
    };
    for i in 0..PAGES {
        let b = page(i);
        let r = c.call(
            Op::Put {
                ns,
                keys: vec![key(i)],
                lens: vec![PAGE],
                meta: Vec::new(),
            },
            &[&b],
        );
        assert_eq!(
            r,
            Reply::Put {
                results: vec![PutStatus::Stored]
            },
            "page {i}"
        );
    }
    let handle = dev.alloc((PAGES * PAGE) as usize, 0);
    let attached = c.call(
        Op::AttachGpu(AttachGpu {
            handle: handle.to_vec().into(),
            device: 0,
            len: PAGES * PAGE,
            layout: GpuLayout {
                base: 0,
                page_stride: PAGE,
                pages: PAGES,
                objects: vec![GpuObject {
                    offset: 0,
                    size: PAGE,
                }],
            },
        }),
        &[],
    );
    assert!(
        matches!(attached, Reply::GpuAttached { .. }),
        "{attached:?}"
    );
    (ns, handle)
}

/// Every GPU page holds its block byte-exactly, and the store holds no lease or reservation.
fn every_page_whole_and_nothing_held(server: &Server, dev: &FakeDevice, handle: &[u8; 64]) {
    let gpu = dev.bytes(handle);
    for i in 0..PAGES {
        let s = (i * PAGE) as usize;
        assert!(gpu[s..s + PAGE as usize] == page(i)[..], "GPU page {i}");
    }
    let t = server.engine.store.snapshot().0.tier;
    assert_eq!((t.leases, t.reserved), (0, 0), "{t:?}");
}

#[test]
fn gpu_onload_larger_than_dram_is_refused_with_the_leasable_prefix_then_loads_in_parts() {
    let server = start();
    let dev = &server.dev;
    let mut c = Raw(UnixStream::connect(&server.socket).unwrap(), 0);
    let (ns, handle) = fill_and_attach(&mut c, dev);

    let leasable = match c.onload(ns, 0, PAGES) {
        Reply::TooLarge { leasable, .. } => u64::from(leasable),
        other => panic!("an onload of 1.5x DRAM from NVMe must be TooLarge: {other:?}"),
    };
    assert!(leasable > 0 && leasable < PAGES, "leasable {leasable}");
    assert!(
        dev.bytes(&handle).iter().all(|&b| b == 0),
        "a refused onload wrote nothing"
    );
    // In leading parts, as the clients split it: every page lands, in order.
    let mut at = 0;
    while at < PAGES {
        let mut n = PAGES - at;
        let results = loop {
            match c.onload(ns, at, n) {
                Reply::Onloaded { results, .. } => break results,
                Reply::TooLarge { leasable, .. } if leasable > 0 && u64::from(leasable) < n => {
                    n = u64::from(leasable);
                }
                other => panic!("onload of {at}..{}: {other:?}", at + n),
            }
        };
        assert!(
            results.iter().all(|r| *r == OnloadStatus::Loaded),
            "{results:?}"
        );
        at += n;
    }
    every_page_whole_and_nothing_held(&server, dev, &handle);
    drop(c);
}

#[test]
fn a_hinted_onload_larger_than_dram_streams_its_local_hits_in_parts_and_refuses_layers() {
    let server = start();
    let dev = &server.dev;
    let mut c = Raw(UnixStream::connect(&server.socket).unwrap(), 0);
    let (ns, handle) = fill_and_attach(&mut c, dev);
    let hinted = |layers: u32| {
        Op::Onload(PageMove {
            ns,
            keys: (0..PAGES).map(key).collect(),
            page_ids: (0..PAGES).collect(),
            buffer: 0,
            layers,
            // No peer is allowed here: the pull is refused, every key is a local hit.
            hint: Some(
                r#"{"source_control_endpoint":"tcp://127.0.0.1:9","block_hashes":[]}"#.into(),
            ),
            deadline_ms: Some(5000),
        })
    };
    match c.call(hinted(2), &[]) {
        Reply::Error { code, message } => {
            assert_eq!(code, kvnode_proto::client::ErrorCode::Invalid);
            assert!(message.contains("layers 0"), "{message}");
        }
        other => panic!("layer-wise with a hint must be refused: {other:?}"),
    }
    // 1.5x DRAM from NVMe: leased, copied and released in parts, every page whole.
    let (results, pull) = match c.call(hinted(0), &[]) {
        Reply::Onloaded { results, pull } => (results, pull.expect("its pull report")),
        other => panic!("hinted onload: {other:?}"),
    };
    assert_eq!(
        results,
        vec![OnloadStatus::Loaded; PAGES as usize],
        "{pull:?}"
    );
    assert!(pull.reason.is_some(), "the refused hint says why: {pull:?}");
    every_page_whole_and_nothing_held(&server, dev, &handle);
}
