//! Smaller attacks (issue 25 item 9). Pins: a cluster key file that is a FIFO or a device
//! is refused at start-up without blocking, and one that others may read is used with a
//! loud warning; 200 connections trickling their request heads to `/metrics` do not blind
//! a scrape; under a tenant map a tenant's `Stats` shows only its own figures (no other
//! tenant's blocks or hits in the tier rows, no slot classes, no client count) and
//! `Histograms` is refused to it.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_misc`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::{Daemon, block, free_port, key, not_root, prerequisite, spec, temp_dir};

fn peer_args(key: &Path) -> Vec<String> {
    let listen = format!("127.0.0.1:{}", free_port());
    [
        "--dram",
        "64MiB",
        "--no-pin",
        "--peer-listen",
        &listen,
        "--advertise",
        &format!("tcp://{listen}"),
        "--cluster-key",
        key.to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec()
}

#[test]
fn a_key_file_that_is_a_fifo_or_a_device_is_refused_without_blocking() {
    let dir = temp_dir("key-fifo");
    let fifo = dir.join("key.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for key in [fifo.as_path(), Path::new("/dev/zero")] {
        let args = peer_args(key);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (st, log) = Daemon::start_failing(&refs, Duration::from_secs(10));
        assert!(!st.success());
        assert!(log.contains("not a regular file"), "{key:?}: {log}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_key_file_others_can_read_is_used_with_a_loud_warning() {
    let dir = temp_dir("key-mode");
    let key = dir.join("cluster.key");
    std::fs::write(&key, "cluster-key-aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let args = peer_args(&key);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = Daemon::start(&refs);
    assert!(
        d.log().contains("CLUSTER KEY FILE IS READABLE"),
        "{}",
        d.log()
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn trickling_heads_do_not_blind_a_metrics_scrape() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let d = Daemon::start(&["--dram", "64MiB", "--no-pin", "--metrics", &listen]);
    // 200 connections that send one byte of a request head every 200 ms.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut conns: Vec<std::net::TcpStream> = (0..200)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let s2 = std::sync::Arc::clone(&stop);
    let trickle = std::thread::spawn(move || {
        let head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n";
        let mut i = 0;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            for c in &mut conns {
                let _ = c.write_all(&head[i % head.len()..=i % head.len()]);
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..3 {
        let t = Instant::now();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        assert!(r.starts_with("HTTP/1.1 200 OK"), "scrape blinded: {r:?}");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "scrape took {:?}",
            t.elapsed()
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
    drop(d);
}

fn probe(uid: u32, socket: &Path, args: &[&str]) -> HashMap<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_tenant_probe"))
        .arg(socket)
        .args(args)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("run tenant_probe");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    kvnode_e2e::key_values(&out.stdout)
}

#[test]
fn a_tenant_sees_only_its_own_figures_in_stats_and_no_histograms() {
    if !prerequisite("root", not_root("the tenant client runs as uid 64001")) {
        return;
    }
    let dir = temp_dir("tenant-stats");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        "socket_mode = 0o666\n[[tenants.tenant]]\nname = \"a\"\nuids = [64001]\n\
         [[tenants.tenant]]\nname = \"b\"\nuids = [64002]\n",
    )
    .unwrap();
    let events = format!("ipc://{}", dir.join("ev.sock").display());
    let d = Daemon::start(&[
        "--dram",
        "64MiB",
        "--no-pin",
        "--config",
        cfg.to_str().unwrap(),
        "--events",
        &events,
    ]);
    // The operator (root, the default tenant) stores 20 blocks and reads them.
    let mut c = d.client();
    let ns = c.register(&spec("operator", 4096)).unwrap().ns;
    let keys: Vec<_> = (0..20).map(key).collect();
    let data: Vec<Vec<u8>> = (0..20).map(|i| block(i, 4096)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, &keys, &refs).unwrap();
    c.get(ns, &keys).unwrap();
    // Tenant a stores 3 blocks.
    let put = probe(64001, d.socket(), &["put", "-", "3", "4096"]);
    assert_eq!(put.get("stored").map(String::as_str), Some("3"), "{put:?}");
    let s = probe(64001, d.socket(), &["stats"]);
    let get = |k: &str| s.get(k).map_or("?", String::as_str).to_owned();
    assert_eq!(get("tenants"), "a");
    assert_eq!(get("tier_blocks.dram"), "3", "{s:?}");
    assert_eq!(get("tier_hits.dram"), "0", "{s:?}");
    assert_eq!(get("pools"), "0");
    assert_eq!(get("clients"), "0");
    assert_eq!(
        get("events"),
        "false",
        "node-wide event counters shown: {s:?}"
    );
    assert!(
        get("histograms_error").contains("only the operator"),
        "{s:?}"
    );
    // The operator still sees everything.
    let all = c.stats().unwrap();
    assert_eq!(all.tiers[0].blocks, 23);
    assert!(all.events.is_some(), "{all:?}");
    assert!(!c.histograms().unwrap().histograms.is_empty());
    let _ = std::fs::remove_dir_all(dir);
}
