//! Hinted GPU onloads through real daemons on the fake GPU (test-seams build with
//! `KVNODE_TEST_FAKE_GPU`: the IPC handle names a file that stands for GPU memory). The
//! destination pulls what it lacks from the hinted peer and copies each page into the "GPU" as
//! soon as its block has landed verified:
//! - a real source: every page lands bitwise, local hits first, and the reply carries the
//!   pull's report; the blocks stay in the DRAM tier, no lease or reservation is left;
//! - a scripted source that holds back block 1 until the test has seen page 0 in GPU memory:
//!   page 0 is onloaded while the rest of the prefix is still on the wire (streaming, not
//!   pull-then-copy);
//! - a cancel while the source is frozen answers at once, and the daemon serves on;
//! - a hint that does not parse fails the pull, reported, with nothing written.
//!
//! Run: `cargo test --release -p kvnode-e2e --test gpu_pulled`.

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use kvnode_client::ClientError;
use kvnode_e2e::peerwire::{accept_pull, send_block, wait_until};
use kvnode_e2e::{Daemon, block, free_port, hint, key, peer_source_args, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::client::ErrorCode;
use kvnode_proto::gpu::{GpuLayout, GpuObject, OnloadStatus};
use kvnode_proto::peer::PeerMsg;
use kvnode_proto::pull::{KeyOutcome, OpState};

const PAGES: u64 = 8;
const PAGE: u64 = 16 << 10;

fn layout() -> GpuLayout {
    GpuLayout {
        base: 0,
        page_stride: PAGE,
        pages: PAGES,
        objects: vec![GpuObject {
            offset: 0,
            size: PAGE,
        }],
    }
}

fn handle(path: &Path) -> [u8; 64] {
    let p = path.to_str().expect("utf-8 path").as_bytes();
    assert!(p.len() < 64, "fake GPU path too long: {}", path.display());
    let mut h = [0u8; 64];
    h[..p.len()].copy_from_slice(p);
    h
}

/// A destination on the fake GPU allowed to pull from `127.0.0.1:port`, and its "GPU" file.
fn dest(port: u16, tag: &str) -> (Daemon, std::path::PathBuf) {
    let file = temp_dir(tag).join("gpu.bin");
    std::fs::write(&file, vec![0u8; (PAGES * PAGE) as usize]).unwrap();
    let peers = format!("tcp://127.0.0.1:{port}");
    let d = Daemon::start_env(
        &[("KVNODE_TEST_FAKE_GPU", "0")],
        &[
            "--dram",
            "64MiB",
            "--no-pin",
            "--no-populate",
            "--peers",
            &peers,
            "--peer-io-timeout-ms",
            "2000",
        ],
    );
    (d, file)
}

/// A real source on a free port holding keys `0..PAGES` ([`block`] contents).
fn filled_source() -> (u16, Daemon, Vec<Key>, Vec<Vec<u8>>) {
    let port = free_port();
    let args = peer_source_args(port, &[]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let src = Daemon::start(&refs);
    let keys: Vec<Key> = (0..PAGES).map(key).collect();
    let data: Vec<Vec<u8>> = (0..PAGES).map(|i| block(i, PAGE as usize)).collect();
    let mut s = src.client();
    let sns = s.register(&spec("m", PAGE)).unwrap().ns;
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    s.put(sns, &keys, &refs).unwrap();
    (port, src, keys, data)
}

fn page_of(file: &Path, p: u64) -> Vec<u8> {
    let b = std::fs::read(file).unwrap();
    b[(p * PAGE) as usize..((p + 1) * PAGE) as usize].to_vec()
}

#[test]
fn a_hinted_onload_pulls_the_missing_pages_and_lands_every_page_bitwise() {
    let (port, _src, keys, data) = filled_source();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();

    let (dst, file) = dest(port, "gpupull");
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE)).unwrap().ns;
    // Key 0 is held here already: a local hit, onloaded without a pull.
    c.put(ns, &keys[..1], &refs[..1]).unwrap();
    let buf = c
        .attach_gpu(&handle(&file), 0, PAGES * PAGE, layout())
        .unwrap();
    // Pages in reverse: key i goes to page 7 - i.
    let pages: Vec<u64> = (0..PAGES).rev().collect();
    let t = c
        .onload_pulled_async(buf, ns, &keys, &pages, &hint(port, &keys), Some(10_000))
        .unwrap();
    let (res, pull) = c.onload_pulled_wait(t).unwrap();
    assert_eq!(res, vec![OnloadStatus::Loaded; PAGES as usize]);
    let pull = pull.expect("a hinted onload reports its pull");
    assert_eq!(pull.state, OpState::Done, "{pull:?}");
    assert_eq!(pull.results[0], KeyOutcome::HitLocal);
    assert!(
        pull.results[1..].iter().all(|r| *r == KeyOutcome::Pulled),
        "{pull:?}"
    );
    for (i, &p) in pages.iter().enumerate() {
        assert_eq!(page_of(&file, p), data[i], "page {p} (key {i})");
    }
    // The pulled blocks stay in the DRAM tier; nothing is left leased or reserved.
    let st = c.stats().unwrap();
    assert_eq!(st.tiers[0].blocks, PAGES, "{:?}", st.tiers[0]);
    assert_eq!(st.tiers[0].reserved, 0);
    assert_eq!(st.gpu.onload_bytes, PAGES * PAGE);
    assert!(c.delete(ns, &keys).is_ok(), "no block is still leased");

    // A second hinted onload of the same keys finds them all local now: no pull runs.
    c.put(ns, &keys, &refs).unwrap();
    let t = c
        .onload_pulled_async(buf, ns, &keys, &pages, &hint(port, &keys), None)
        .unwrap();
    let (res, pull) = c.onload_pulled_wait(t).unwrap();
    assert_eq!(res, vec![OnloadStatus::Loaded; PAGES as usize]);
    assert!(
        pull.unwrap()
            .results
            .iter()
            .all(|r| *r == KeyOutcome::HitLocal),
        "all local"
    );
}

#[test]
fn pages_go_into_the_gpu_while_later_blocks_are_still_on_the_wire() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (dst, file) = dest(port, "gpustream");
    let watched = file.clone();
    let keys: Vec<Key> = (0..2).map(key).collect();
    let src = std::thread::spawn(move || {
        let (mut w, req, _) = accept_pull(&l);
        send_block(&mut w, req, 0, &block(0, PAGE as usize));
        // Block 1 is held back until block 0 is in GPU memory (page 3).
        let want = block(0, PAGE as usize);
        let seen = wait_until(|| page_of(&watched, 3) == want);
        send_block(&mut w, req, 1, &block(1, PAGE as usize));
        w.send(&PeerMsg::Done { req }, &[]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        seen
    });
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE)).unwrap().ns;
    let buf = c
        .attach_gpu(&handle(&file), 0, PAGES * PAGE, layout())
        .unwrap();
    let t = c
        .onload_pulled_async(buf, ns, &keys, &[3, 5], &hint(port, &keys), Some(20_000))
        .unwrap();
    let (res, pull) = c.onload_pulled_wait(t).unwrap();
    assert!(
        src.join().unwrap(),
        "page 0 never reached the GPU before block 1 was sent: the onload waited for the whole pull"
    );
    assert_eq!(res, vec![OnloadStatus::Loaded; 2], "{pull:?}");
    assert_eq!(page_of(&file, 5), block(1, PAGE as usize));
}

#[test]
fn cancel_of_a_hinted_onload_answers_while_the_source_is_frozen_and_a_bad_hint_fails_only_the_pull()
{
    let (port, src, keys, _) = filled_source();
    let (dst, file) = dest(port, "gpucancel");
    let mut c = dst.client();
    let ns = c.register(&spec("m", PAGE)).unwrap().ns;
    let buf = c
        .attach_gpu(&handle(&file), 0, PAGES * PAGE, layout())
        .unwrap();
    let pages: Vec<u64> = (0..PAGES).collect();

    // A hint that does not parse fails the pull (its report says why), not the onload.
    let m = c.onload_pulled_async(buf, ns, &keys, &pages, "not json", None);
    assert!(m.is_ok(), "a bad hint ends the pull, not the onload: {m:?}");
    let (res, pull) = c.onload_pulled_wait(m.unwrap()).unwrap();
    assert_eq!(res, vec![OnloadStatus::Miss; PAGES as usize]);
    assert_eq!(pull.unwrap().state, OpState::Failed);

    src.freeze();
    let t0 = Instant::now();
    let t = c
        .onload_pulled_async(buf, ns, &keys, &pages, &hint(port, &keys), Some(60_000))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let res = c.onload_cancel(t).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "cancel waited for the frozen source: {:?}",
        t0.elapsed()
    );
    assert_eq!(res, vec![OnloadStatus::Cancelled; PAGES as usize]);
    assert!(
        std::fs::read(&file).unwrap().iter().all(|&b| b == 0),
        "a cancelled onload wrote GPU memory"
    );
    match c.onload_layer_wait(t, 0) {
        Err(ClientError::Server { code, .. }) => assert_eq!(code, ErrorCode::NotOwned),
        other => panic!("a finished ticket must be unknown: {other:?}"),
    }
    c.stats().unwrap();
}
