//! UCX's software transport against anyone who reaches the daemon's UCX worker (issue 38,
//! item 1): no cluster key, no client socket, no view of peer traffic. The attacker
//! (`peer-attacker ucx-forge`, tests/src/ucxforge.rs) finds the daemon's UCX port in
//! `/proc/PID/net/tcp`, forges a worker address from its own with that port, and GETs an
//! unmapped address: on 894818a the daemon died of SIGSEGV inside UCX's GET handler, and a
//! GET of the arena read any tenant's block.
//!
//! What is pinned: a daemon refuses to run UCX over software RMA unless the trusted-network
//! switch says so (`--peer-transport ucx` fails to start with an error naming it, `auto`
//! falls back to TCP and opens no UCX port); with the switch, UCX listens on the peer
//! interface only; a daemon without a peer listener starts no UCX worker at all.
//! Run: `cargo test --release -p kvnode-e2e --test attack_ucx`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvnode_e2e::ucxforge::listening_ports;
use kvnode_e2e::{Daemon, free_port, key, spec};

const PAGE: u64 = 64 << 10;

fn tcp() -> [(&'static str, &'static str); 1] {
    [("UCX_TLS", "tcp")]
}

/// A cluster key file the attacker does not have (the daemons here are keyed members).
fn cluster_key() -> String {
    let dir = kvnode_e2e::temp_dir("ucx-key");
    let k = dir.join("cluster.key");
    std::fs::write(&k, "attack-ucx-cluster-key-0123456789abcdef\n").unwrap();
    k.to_str().unwrap().to_owned()
}

/// A keyed daemon (64 MiB) with a peer listener on loopback `port`, UCX's TCP transport
/// enabled, `--peer-transport transport`, plus `extra`.
fn keyed_listener(port: u16, transport: &str, extra: &[&str]) -> Daemon {
    let listen = format!("127.0.0.1:{port}");
    let key_file = cluster_key();
    let mut args = vec!["--dram", "64MiB", "--no-pin", "--cluster-key", &key_file];
    args.extend_from_slice(&["--peer-listen", &listen, "--peer-transport", transport]);
    args.extend_from_slice(extra);
    Daemon::start_env(&tcp(), &args)
}

/// Runs the forged-address attack on `d`: one GET of `len` bytes at `addr` through every
/// listening port of the daemon but `own`. Returns the attacker's report.
fn forge(d: &Daemon, own: &[u16], addr: u64, len: usize) -> String {
    let own: Vec<String> = own.iter().map(ToString::to_string).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_peer-attacker"))
        .args(["ucx-forge", &d.child.id().to_string(), &own.join(",")])
        .arg(format!("{addr:x}"))
        .arg(len.to_string())
        .env("UCX_TLS", "tcp")
        .stderr(Stdio::inherit())
        .output()
        .expect("run peer-attacker");
    assert!(out.status.success(), "attacker failed: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether the daemon still runs and answers, `limit` after the attack.
fn still_serving(d: &mut Daemon, limit: Duration) -> Result<(), String> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(st) = d.child.try_wait().unwrap() {
            return Err(format!("the daemon died: {st:?}\n{}", d.log()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    d.client().stats().map(|_| ()).map_err(|e| e.to_string())
}

fn field<'a>(report: &'a str, k: &str) -> Vec<&'a str> {
    report
        .lines()
        .filter_map(|l| l.strip_prefix(k)?.strip_prefix('='))
        .collect()
}

#[test]
fn a_forged_ucx_worker_address_finds_no_worker_and_cannot_crash_the_daemon() {
    // As the issue ran it: a UCX-capable daemon (auto) on a node with no RDMA device, UCX's
    // TCP transport enabled, a peer listener on loopback.
    let port = free_port();
    let mut d = keyed_listener(port, "auto", &[]);
    let mut c = d.client();
    let ns = c.register(&spec("m", PAGE)).unwrap().ns;
    let secret = vec![0x5a_u8; PAGE as usize];
    c.put(ns, &[key(9)], &[&secret]).unwrap();
    // One GET at an unmapped address through every UCX port the daemon has.
    let report = forge(&d, &[port], 0x10000, 64);
    let alive = still_serving(&mut d, Duration::from_secs(2));
    assert!(
        alive.is_ok(),
        "a forged UCX endpoint crashed the daemon: {alive:?}\nattack: {report}"
    );
    assert_eq!(
        field(&report, "ucx_ports"),
        ["0"],
        "the daemon has UCX ports open to anyone on loopback: {report}\n{}",
        d.log()
    );
    assert_eq!(field(&report, "endpoints"), ["0"], "{report}");
    assert!(
        d.log().contains("auto: UCX unavailable")
            && d.log().contains("--peer-ucx-insecure-software-rma"),
        "the daemon did not say why UCX is off:\n{}",
        d.log()
    );
}

#[test]
fn ucx_over_software_rma_refuses_to_start_without_the_trusted_network_switch() {
    let dir = kvnode_e2e::temp_dir("ucx-soft");
    let port = free_port();
    let mut child = kvnode_e2e::kvnode_cmd()
        .args(["serve", "--dram", "64MiB", "--no-pin", "--socket"])
        .arg(dir.join("k.sock"))
        .args(["--peer-listen", &format!("127.0.0.1:{port}")])
        .args(["--cluster-key", &cluster_key()])
        .args(["--peer-transport", "ucx"])
        .envs(tcp())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = kvnode_e2e::child_exit(&mut child, Duration::from_secs(10));
    let still = status.is_none();
    if still {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !still,
        "a daemon serving UCX over its TCP transport started without the switch:\n{err}"
    );
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("in software over tcp/") && err.contains("--peer-ucx-insecure-software-rma"),
        "the refusal does not say what is wrong and what to do:\n{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ucx_on_a_trusted_network_listens_on_the_peer_interface_only() {
    let port = free_port();
    let d = keyed_listener(port, "ucx", &["--peer-ucx-insecure-software-rma"]);
    assert!(
        d.log().contains("transport ucx")
            && d.log().contains("SERVES REMOTE MEMORY ACCESS IN SOFTWARE"),
        "{}",
        d.log()
    );
    let ports = listening_ports(&d.child.id().to_string());
    let ucx: Vec<&(String, u16)> = ports.iter().filter(|(_, p)| *p != port).collect();
    assert!(!ucx.is_empty(), "no UCX worker listens: {ports:?}");
    // /proc/net/tcp prints 127.0.0.1 as 0100007F.
    let elsewhere: Vec<&&(String, u16)> = ucx
        .iter()
        .filter(|(a, _)| !a.starts_with("0100007F:"))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "UCX listens beyond the peer interface (lo): {elsewhere:?}"
    );
}

#[test]
fn a_daemon_without_a_peer_listener_starts_no_ucx_worker() {
    let other = free_port();
    let peers = format!("tcp://127.0.0.1:{other}");
    let d = Daemon::start_env(
        &tcp(),
        &[
            "--dram",
            "64MiB",
            "--no-pin",
            "--peers",
            &peers,
            "--peer-transport",
            "ucx",
            "--peer-ucx-insecure-software-rma",
        ],
    );
    assert!(d.log().contains("transport ucx"), "{}", d.log());
    let ports = listening_ports(&d.child.id().to_string());
    assert!(
        ports.is_empty(),
        "a daemon that serves no peers listens on TCP (UCX worker): {ports:?}"
    );
}
