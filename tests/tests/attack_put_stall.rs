//! Attacks that hold DRAM reservations with stalled puts (issue 25 item 6). Pins: a `Put`
//! whose payload stalls is cut off at its deadline (`put_payload_timeout_s` + 1 s per
//! 64 MiB): the connection is closed, its reservations are freed, and
//! `kvnode_put_payload_timeouts_total` counts it, so other clients' puts are stored again;
//! with a tenant map, the `default` tenant (every unmapped uid) gets a quarter of the tier
//! unless configured otherwise, so its stalled puts cannot starve a mapped tenant even
//! before their deadline.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_put_stall`.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::raw::Raw;
use kvnode_e2e::{Daemon, free_port, key, not_root, prerequisite, spec, temp_dir};
use kvnode_proto::client::{Op, PutStatus, Request};
use kvnode_proto::frame::encode_frame;

const MIB: u64 = 1 << 20;

/// Opens a connection that sends a `Put` header for 8 blocks of 1 MiB and no payload.
fn stalled_put(d: &Daemon, ns: u32, first: u64) -> Raw {
    let mut r = Raw::connect(d, true);
    let keys = (first..first + 8).map(key).collect();
    let req = Request {
        id: 7,
        op: Op::Put {
            ns,
            keys,
            lens: vec![MIB; 8],
            meta: Vec::new(),
        },
    };
    let f = encode_frame(&req, 8 * MIB).unwrap();
    r.0.write_all(&f).unwrap();
    r
}

fn config(extra: &str) -> std::path::PathBuf {
    let dir = temp_dir("put-stall");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(&cfg, extra).unwrap();
    cfg
}

fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r
}

#[test]
fn a_stalled_put_is_cut_off_and_its_reservations_freed() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let cfg = config("put_payload_timeout_s = 1.0\n");
    let d = Daemon::start(&[
        "--dram",
        "64MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--config",
        cfg.to_str().unwrap(),
        "--metrics",
        &listen,
    ]);
    let mut c = d.client();
    let ns = c.register(&spec("stall", MIB)).unwrap().ns;
    // 12 x 8 MiB of reservations against a 64 MiB tier.
    let t0 = Instant::now();
    let mut stalled: Vec<Raw> = (0..12).map(|i| stalled_put(&d, ns, 1000 + i * 8)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let b = vec![5u8; MIB as usize];
    let r = c.put(ns, &[key(1)], &[&b]).unwrap();
    assert_eq!(
        r,
        vec![PutStatus::NoSpace],
        "the attack must fill the tier first"
    );
    // Each stalled put is cut off within its deadline (1 s + 8 MiB / 64 MiB/s), plus slack.
    for s in &mut stalled {
        s.0.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(s.closed(), "a stalled put's connection stays open");
    }
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    let r = c.put(ns, &[key(2)], &[&b]).unwrap();
    assert_eq!(r, vec![PutStatus::Stored]);
    assert_eq!(c.stats().unwrap().tiers[0].reserved, 0);
    let m = scrape(port);
    assert!(m.contains("kvnode_put_payload_timeouts_total 12"), "{m}");
    assert!(d.log().contains("put payload did not arrive in time"));
}

#[test]
fn the_default_tenant_cannot_starve_a_mapped_tenant_with_stalled_puts() {
    if !prerequisite("root", not_root("the victim client runs as uid 64001")) {
        return;
    }
    let cfg = config("socket_mode = 0o666\n[[tenants.tenant]]\nname = \"a\"\nuids = [64001]\n");
    let d = Daemon::start(&[
        "--dram",
        "64MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    // Root is unmapped: the default tenant.
    let mut c = d.client();
    let ns = c.register(&spec("stall", MIB)).unwrap().ns;
    let _stalled: Vec<Raw> = (0..12).map(|i| stalled_put(&d, ns, 1000 + i * 8)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new(env!("CARGO_BIN_EXE_tenant_probe"))
        .arg(d.socket())
        .args(["put", "-", "4", &MIB.to_string()])
        .uid(64001)
        .gid(64001)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l == "stored 4"),
        "tenant a's puts while the default tenant stalls:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
