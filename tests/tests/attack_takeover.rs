//! Attacks on `kvnode serve --takeover` (issue 25 item 8). Pins: a socket directory that
//! other users may write is refused at start-up unless `--allow-shared-socket-dir`; a
//! successor refuses a takeover socket answered by another uid before sending it anything;
//! a successor refuses a listener that is not bound to its `--socket`; a successor that
//! goes away mid-hand-over leaves the donor serving with every block; silent connections
//! to the takeover socket do not hold up a real successor.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_takeover`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvnode_e2e::{Daemon, block, key, kvnode_bin, not_root, prerequisite, spec, temp_dir};

const LEN: usize = 64 << 10;
const ARGS: [&str; 5] = ["--dram", "64MiB", "--slab-size", "2MiB", "--no-pin"];

fn shared_dir(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    d
}

/// Runs `kvnode serve --socket <socket> <args>` until it exits (at most `limit`).
fn run_to_exit(socket: &Path, args: &[&str], limit: Duration) -> (bool, String) {
    let out = temp_dir("takeover-out").join("log");
    let mut child = Command::new(kvnode_bin())
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&out).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (
                s.success(),
                std::fs::read_to_string(&out).unwrap_or_default(),
            );
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "kvnode serve {args:?} still runs after {limit:?}:\n{}",
                std::fs::read_to_string(&out).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn seed(d: &Daemon) -> u32 {
    let mut c = d.client();
    let ns = c.register(&spec("takeover", LEN as u64)).unwrap().ns;
    for i in 0..16 {
        let b = block(i, LEN);
        c.put(ns, &[key(i)], &[&b]).unwrap();
    }
    ns
}

fn intact(d: &Daemon, ns: u32) -> usize {
    let mut c = d.client();
    let keys: Vec<_> = (0..16).map(key).collect();
    let got = c.get(ns, &keys).unwrap();
    got.iter()
        .enumerate()
        .filter(|(i, g)| g.as_deref() == Some(block(*i as u64, LEN).as_slice()))
        .count()
}

#[test]
fn a_socket_dir_others_can_write_is_refused_unless_allowed() {
    let dir = shared_dir("takeover-shared");
    let sock = dir.join("kvnode.sock");
    let (ok, log) = run_to_exit(&sock, &ARGS, Duration::from_secs(20));
    assert!(!ok);
    assert!(log.contains("may be written by other users"), "{log}");
    assert!(!sock.exists());
    let mut args = ARGS.to_vec();
    args.push("--allow-shared-socket-dir");
    let d = Daemon::start_at(&sock, &args);
    assert!(d.log().contains("--allow-shared-socket-dir"), "{}", d.log());
}

/// A script run as another uid (or root): binds `path`, says `ready`, serves one
/// connection as `mode` says, and prints what it received.
fn python(uid: u32, path: &Path, mode: &str) -> std::process::Child {
    let script = r#"
import os, socket, sys
path, mode = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(4)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(5)
try:
    got = c.recv(65536)
except Exception:
    got = b""
print("got", len(got), flush=True)
if mode == "donor":
    c.sendall(b'{"ok":true,"error":null,"pid":1,"image_len":0,"blocks":0}\n')
    m = os.memfd_create("fake-arena"); os.ftruncate(m, 64 << 20)
    other = socket.socket(socket.AF_UNIX); other.bind(path + ".elsewhere"); other.listen(1)
    socket.send_fds(c, [b"F"], [m]); socket.send_fds(c, [b"F"], [other.fileno()])
    try:
        c.recv(100)
    except Exception:
        pass
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script])
        .arg(path)
        .arg(mode)
        .uid(uid)
        .gid(uid)
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("python3");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    child.stdout = Some(out.into_inner());
    child
}

fn received(mut child: std::process::Child) -> String {
    let mut s = String::new();
    child.stdout.take().unwrap().read_to_string(&mut s).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    s
}

#[test]
fn a_successor_refuses_a_takeover_socket_answered_by_another_uid() {
    if !prerequisite("root", not_root("the impostor runs as uid 64003")) {
        return;
    }
    let dir = shared_dir("takeover-impostor");
    let sock = dir.join("kvnode.sock");
    let impostor = python(64003, &dir.join("kvnode.sock.takeover"), "silent");
    let mut args = ARGS.to_vec();
    args.extend(["--allow-shared-socket-dir", "--takeover"]);
    let (ok, log) = run_to_exit(&sock, &args, Duration::from_secs(20));
    assert!(!ok, "{log}");
    assert!(log.contains("runs as uid 64003"), "{log}");
    let seen = received(impostor);
    assert!(seen.contains("got 0"), "the impostor was sent: {seen}");
}

#[test]
fn a_successor_refuses_a_listener_bound_elsewhere() {
    let dir = temp_dir("takeover-elsewhere");
    let sock = dir.join("kvnode.sock");
    let donor = python(0, &dir.join("kvnode.sock.takeover"), "donor");
    let mut args = ARGS.to_vec();
    args.push("--takeover");
    let (ok, log) = run_to_exit(&sock, &args, Duration::from_secs(20));
    assert!(!ok, "{log}");
    assert!(log.contains("not to --socket"), "{log}");
    drop(received(donor));
}

#[test]
fn a_successor_that_vanishes_mid_handover_leaves_the_donor_serving() {
    let dir = temp_dir("takeover-vanish");
    let sock = dir.join("kvnode.sock");
    let mut d = Daemon::start_at(&sock, &ARGS);
    let ns = seed(&d);
    let mut s = UnixStream::connect(dir.join("kvnode.sock.takeover")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let ask = format!(
        "{{\"version\":\"0\",\"pid\":{},\"dram\":{},\"slab_bytes\":{},\"hugetlb\":false,\"image_formats\":[\"KVNDRAM1\"]}}\n",
        std::process::id(),
        64u64 << 20,
        2u64 << 20
    );
    s.write_all(ask.as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    drop(s);
    let t = Instant::now();
    while !d.log().contains("serving again") {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "donor did not resume:\n{}",
            d.log()
        );
        assert!(
            d.child.try_wait().unwrap().is_none(),
            "donor exited:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d.wait_ready(Duration::from_secs(5));
    assert_eq!(intact(&d, ns), 16);
    assert!(d.wait_exit(Duration::from_millis(200)).is_none());
}

#[test]
fn silent_takeover_connections_do_not_hold_up_a_real_successor() {
    let dir = temp_dir("takeover-silent");
    let sock = dir.join("kvnode.sock");
    let mut a = Daemon::start_at(&sock, &ARGS);
    let ns = seed(&a);
    let _silent: Vec<UnixStream> = (0..10)
        .map(|_| UnixStream::connect(dir.join("kvnode.sock.takeover")).unwrap())
        .collect();
    let t = Instant::now();
    let mut args = ARGS.to_vec();
    args.push("--takeover");
    let b = Daemon::spawn_at(&sock, &args);
    let st = a.wait_exit(Duration::from_secs(40));
    assert!(st.is_some_and(|s| s.success()), "donor:\n{}", a.log());
    b.wait_ready(Duration::from_secs(10));
    let took = t.elapsed();
    assert!(took < Duration::from_secs(15), "takeover took {took:?}");
    assert_eq!(intact(&b, ns), 16);
}
