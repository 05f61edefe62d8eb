//! Per-client caps (issue 38 items 6 and 7), each attack against real daemons. Pins: one uid
//! opening connection after connection and attaching every region it may cannot take the
//! daemon's descriptors (it is refused `LimitReached` at its caps, and another tenant still
//! connects and gets); one connection leasing one block over and over is refused
//! `LimitReached` at its cap and the daemon's heap stays bounded; one tenant flooding
//! hinted `Exists` at a peer cannot get another tenant's hinted gets refused `PeerBusy`.
//! Every test uses default caps and config keys the build before them already had, so it
//! fails there for the reason its name gives (docs/operations.md shows how).
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_caps`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvnode_client::ClientError;
use kvnode_e2e::{
    Daemon, block, free_port, key, kvnode_bin, not_root, prerequisite, spec, stats_text, temp_dir,
};
use kvnode_proto::client::ErrorCode;

const UID_A: u32 = 64001;
const UID_B: u32 = 64002;

fn can_switch_uids() -> bool {
    prerequisite(
        "root",
        not_root("the tests run clients as uids 64001 and 64002"),
    )
}

/// A config with tenants `a` (uid 64001) and `b` (uid 64002), a socket every uid may open,
/// and `extra` lines at the top.
fn config(extra: &str) -> PathBuf {
    let cfg = temp_dir("caps-cfg").join("kvnode.toml");
    std::fs::write(
        &cfg,
        format!(
            "socket_mode = 0o666\n{extra}\n\
             [[tenants.tenant]]\nname = \"a\"\nuids = [{UID_A}]\n\
             [[tenants.tenant]]\nname = \"b\"\nuids = [{UID_B}]\n"
        ),
    )
    .unwrap();
    cfg
}

/// The probe as `uid` (gid = uid), started with piped stdin and stdout.
fn spawn_probe(uid: u32, socket: &Path, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_caps_probe"))
        .arg(socket)
        .args(args)
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run caps_probe")
}

/// Reads the probe's `key value` lines until `until` (or its end) within `limit`; `None`
/// when it did not get there in time (the probe is then killed).
fn lines(p: &mut Child, until: Option<&str>, limit: Duration) -> Option<HashMap<String, String>> {
    let (tx, rx) = mpsc::channel();
    let stdout = p.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let t = Instant::now();
    let mut m = HashMap::new();
    loop {
        let left = limit.saturating_sub(t.elapsed());
        match rx.recv_timeout(left) {
            Ok(l) => {
                let (k, v) = l.split_once(' ').unwrap_or((l.as_str(), ""));
                m.insert(k.to_owned(), v.to_owned());
                if until.is_some_and(|u| u == k) {
                    return Some(m);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) if until.is_none() => return Some(m),
            Err(_) => {
                let _ = p.kill();
                let _ = p.wait();
                return None;
            }
        }
    }
}

/// Runs the probe as `uid` to its end within `limit`.
fn probe(
    uid: u32,
    socket: &Path,
    args: &[&str],
    limit: Duration,
) -> Option<HashMap<String, String>> {
    let mut p = spawn_probe(uid, socket, args);
    let m = lines(&mut p, None, limit);
    let _ = p.wait();
    m
}

fn get<'a>(m: &'a HashMap<String, String>, k: &str) -> &'a str {
    m.get(k)
        .map_or_else(|| panic!("no {k} in {m:?}"), String::as_str)
}

fn num(m: &HashMap<String, String>, k: &str) -> u64 {
    get(m, k).parse().unwrap_or_else(|_| panic!("{k} in {m:?}"))
}

/// A daemon whose descriptor limit is 1024 (soft and hard), as on many hosts.
fn daemon_with_1024_descriptors(args: &[&str]) -> Daemon {
    let mut cmd = Command::new(kvnode_bin());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child before exec.
    unsafe {
        cmd.pre_exec(|| {
            let r = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Daemon::spawn(cmd, args)
}

fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    r
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[test]
fn one_uid_opening_connections_and_regions_cannot_lock_another_tenant_out() {
    if !can_switch_uids() {
        return;
    }
    let cfg = config("");
    let mport = free_port();
    let metrics = format!("127.0.0.1:{mport}");
    let d = daemon_with_1024_descriptors(&[
        "--dram",
        "64MiB",
        "--no-pin",
        "--metrics",
        &metrics,
        "--config",
        cfg.to_str().unwrap(),
    ]);
    // Tenant a's uid opens 200 connections and attaches 16 regions on each (3,400
    // descriptors in a daemon that may have 1,024), and holds them.
    let mut hog = spawn_probe(UID_A, d.socket(), &["hog", "200", "16"]);
    let held = lines(&mut hog, Some("ready"), Duration::from_mins(3))
        .expect("the hog reports what it holds");
    // Meanwhile tenant b's uid connects, puts and gets.
    eprintln!("tenant a holds: {held:?}");
    let victim = probe(UID_B, d.socket(), &["victim"], Duration::from_secs(20));
    let victim = victim.unwrap_or_else(|| {
        panic!(
            "tenant b could not connect and get within 20 s while tenant a held {held:?}; daemon log tail:\n{}",
            tail(&d.log())
        )
    });
    let stats = d.client().stats().expect("stats as the operator");
    let text = stats_text(d.socket());
    drop(hog.stdin.take());
    let _ = hog.wait();
    assert_eq!(get(&victim, "victim_ok"), "1", "tenant b: {victim:?}");
    // a was refused past its caps with the typed error, and never failed otherwise.
    assert_eq!(get(&held, "connections_code"), "LimitReached", "{held:?}");
    assert_eq!(get(&held, "regions_code"), "LimitReached", "{held:?}");
    assert_eq!(num(&held, "connections_failed"), 0, "{held:?}");
    assert_eq!(num(&held, "regions_failed"), 0, "{held:?}");
    let (conns, regions) = (num(&held, "connections"), num(&held, "regions"));
    assert!(
        conns + regions <= 1024 / 4,
        "a held {conns} + {regions}: {held:?}"
    );
    assert_eq!(num(&held, "connections_refused"), 200 - conns);
    // Counted per tenant in stats and by reason in /metrics.
    let row = stats
        .tenants
        .iter()
        .find(|t| t.name == "a")
        .expect("tenant a");
    assert_eq!((row.connections, row.regions), (conns, regions), "{row:?}");
    assert_eq!(row.refused_connections, 200 - conns, "{row:?}");
    assert!(row.refused_regions > 0, "{row:?}");
    assert!(text.contains("leased blocks"), "{text}");
    let m = scrape(mport);
    assert_eq!(
        metric(&m, "kvnode_clients_refused_total{reason=\"connections\"} "),
        200 - conns,
        "{m}"
    );
    assert!(metric(&m, "kvnode_clients_refused_total{reason=\"regions\"} ") > 0);
    assert!(
        metric(
            &m,
            "kvnode_tenant_limit_refusals_total{tenant=\"a\",what=\"regions\"} "
        ) > 0
    );
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The daemon's resident memory, bytes.
fn rss(d: &Daemon) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{}/status", d.child.id())).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb << 10
}

#[test]
fn one_connection_leasing_one_block_again_and_again_is_refused_at_its_cap_with_bounded_heap() {
    let d = Daemon::start(&["--dram", "64MiB", "--no-pin"]);
    let mut c = d.client();
    let ns = c.register(&spec("lease-hog", 4096)).unwrap().ns;
    c.put(ns, &[key(1)], &[block(1, 4096).as_slice()]).unwrap();
    let batch = vec![key(1); 64 << 10];
    let before = rss(&d);
    // 12 Mi leases of one block (the attacker took 21.6 M), none released.
    let (mut leased, mut refused) = (0u64, None);
    for _ in 0..192 {
        match c.get_lease(ns, &batch) {
            Ok(l) => leased += l.extents.iter().flatten().count() as u64,
            Err(ClientError::Server { code, message }) => {
                refused = Some((code, message));
                break;
            }
            Err(e) => panic!("lease after {leased}: {e}"),
        }
    }
    let grown = rss(&d).saturating_sub(before);
    eprintln!(
        "{leased} leases, refused: {refused:?}, the daemon grew by {} MiB",
        grown >> 20
    );
    assert!(
        grown < 200 << 20,
        "the daemon grew by {} MiB holding {leased} leases of one block",
        grown >> 20
    );
    let (code, message) =
        refused.unwrap_or_else(|| panic!("{leased} leases granted, none refused"));
    assert_eq!(code, ErrorCode::LimitReached, "{message}");
    assert!(message.contains("leased_blocks_per_uid"), "{message}");
    assert_eq!(leased, 1 << 20, "the default cap is 1 Mi blocks");
    // Released, they come back under the cap.
    drop(c);
    let mut c = d.client();
    let ns = c.register(&spec("lease-hog", 4096)).unwrap().ns;
    assert!(c.get_lease(ns, &batch).is_ok());
}

#[test]
fn a_tenants_flood_of_hinted_exists_does_not_get_another_tenants_hinted_gets_refused_busy() {
    if !can_switch_uids() {
        return;
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let adv = format!("tcp://{listen}");
    let kdir = temp_dir("caps-key");
    let k = kdir.join("k");
    std::fs::write(&k, "caps-cluster-key-dddddddddddddddddddd\n").unwrap();
    let k = k.to_str().unwrap();
    let base = ["--dram", "128MiB", "--no-pin", "--cluster-key", k];
    let src_cfg = config("");
    let mut src_args = base.to_vec();
    src_args.extend(["--config", src_cfg.to_str().unwrap()]);
    src_args.extend(["--peer-listen", &listen, "--advertise", &adv]);
    let src = Daemon::start(&src_args);
    // The destination allows 64 keys in flight to a peer.
    let dst_cfg = config("[peer]\nmax_outstanding_keys = 64\nconnect_timeout_ms = 3000\n");
    let mut dst_args = base.to_vec();
    dst_args.extend([
        "--config",
        dst_cfg.to_str().unwrap(),
        "--peers",
        "127.0.0.0/8",
    ]);
    let dst = Daemon::start(&dst_args);
    let len = (64 << 10).to_string();
    let put = probe(
        UID_A,
        src.socket(),
        &["put", "80", &len],
        Duration::from_mins(1),
    )
    .unwrap();
    assert_eq!(get(&put, "stored"), "80");
    // Tenant b floods the peer for 8 s with hinted Exists of 64 keys it lacks (the whole
    // cap per op), from three clients.
    let p = port.to_string();
    let mut floods: Vec<Child> = (0..3)
        .map(|_| spawn_probe(UID_B, dst.socket(), &["flood", &p, "8", "64"]))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    // Tenant a's 20 hinted gets of 4 keys each, meanwhile.
    let a = probe(
        UID_A,
        dst.socket(),
        &["pulls", &p, "20", "4", &len],
        Duration::from_mins(1),
    );
    let (mut ops, mut busy) = (0, 0);
    for f in &mut floods {
        let m = lines(f, None, Duration::from_mins(1)).expect("the flood ends");
        let _ = f.wait();
        (ops, busy) = (ops + num(&m, "floods"), busy + num(&m, "flood_busy"));
    }
    let a = a.expect("tenant a's gets finish");
    eprintln!("tenant a: {a:?}; tenant b's flood: {ops} ops, {busy} refused PeerBusy");
    // The flood did fill the link: some of b's own ops found it full.
    assert!(busy > 0, "b's {ops} flooding ops never found the link full");
    assert_eq!(
        num(&a, "busy"),
        0,
        "tenant a's hinted gets refused PeerBusy during b's flood: {a:?}"
    );
    assert_eq!(num(&a, "pulled"), 20, "{a:?}");
}
