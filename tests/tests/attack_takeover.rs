//! Attacks on `kvnode serve --takeover` (issue 25 item 8, issue 38 item 2). Pins: a socket
//! directory that other users may write is refused at start-up unless
//! `--allow-shared-socket-dir`; the takeover socket is not in the client socket's directory
//! (engines see that one) but in a 0700 directory of its own; a root process that is not the
//! daemon's uid, and another uid, get no arena from a service user's takeover socket and the
//! daemon keeps serving; a successor refuses a takeover socket answered by another uid (root
//! included) before sending it anything; a successor refuses a listener that is not bound to
//! its `--socket`; a successor that goes away mid-hand-over leaves the donor serving with
//! every block; silent connections to the takeover socket do not hold up a real successor.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_takeover`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvnode_e2e::{
    Daemon, admin_dir_of, block, key, kvnode_cmd, not_root, prerequisite, spec, takeover_socket_of,
    temp_dir,
};

const LEN: usize = 64 << 10;
const ARGS: [&str; 5] = ["--dram", "64MiB", "--slab-size", "2MiB", "--no-pin"];

fn shared_dir(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    d
}

/// Runs `kvnode serve --socket <socket> <args>` until it exits (at most `limit`).
fn run_to_exit(socket: &Path, args: &[&str], limit: Duration) -> (bool, String) {
    run_cmd_to_exit(kvnode_cmd(), socket, args, limit)
}

/// [`run_to_exit`] with a prepared command (its uid).
fn run_cmd_to_exit(
    mut cmd: Command,
    socket: &Path,
    args: &[&str],
    limit: Duration,
) -> (bool, String) {
    let out = temp_dir("takeover-out").join("log");
    let mut child = cmd
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

/// A successor's request that fits [`ARGS`]' DRAM layout.
fn ask() -> String {
    format!(
        "{{\"version\":\"0\",\"pid\":{},\"dram\":{},\"slab_bytes\":{},\"hugetlb\":false,\"image_formats\":[\"KVNDRAM1\"]}}\n",
        std::process::id(),
        64u64 << 20,
        2u64 << 20
    )
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

/// A helper process, killed when the test ends (a failed assertion included): one left
/// running would hold the test's output open.
struct Script(std::process::Child);

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A script run as another uid (or root): binds `path`, says `ready`, serves one
/// connection as `mode` says, and prints what it received.
fn python(uid: u32, path: &Path, mode: &str) -> Script {
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
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", script])
        .arg(path)
        .arg(mode)
        .uid(uid)
        .gid(uid)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Script(cmd.spawn().expect("python3"));
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    child.0.stdout = Some(out.into_inner());
    child
}

/// What the script printed once it ended (it serves one connection, then exits).
fn received(mut child: Script) -> String {
    let mut s = String::new();
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    s
}

#[test]
fn a_successor_refuses_a_takeover_socket_answered_by_another_uid() {
    if !prerequisite("root", not_root("the impostor runs as uid 64003")) {
        return;
    }
    let dir = shared_dir("takeover-impostor");
    let sock = dir.join("kvnode.sock");
    // The impostor binds where it may write, and the socket is moved into the (root-owned,
    // 0700) takeover directory: the uid check is what stands, not the directory.
    let impostor = python(64003, &dir.join("impostor.sock"), "silent");
    std::fs::create_dir_all(admin_dir_of(&sock)).unwrap();
    std::fs::rename(dir.join("impostor.sock"), takeover_socket_of(&sock)).unwrap();
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
    std::fs::create_dir_all(admin_dir_of(&sock)).unwrap();
    let donor = python(0, &takeover_socket_of(&sock), "donor");
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
    let mut s = UnixStream::connect(takeover_socket_of(&sock)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(ask().as_bytes()).unwrap();
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
        .map(|_| UnixStream::connect(takeover_socket_of(&sock)).unwrap())
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

#[test]
fn the_takeover_socket_is_not_in_the_client_sockets_directory() {
    let dir = temp_dir("takeover-layout");
    let sock = dir.join("kvnode.sock");
    let _d = Daemon::start_at(&sock, &ARGS);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["kvnode.sock"],
        "the client socket's directory (what engine pods mount) holds more than the client socket"
    );
    let t = takeover_socket_of(&sock);
    let md = std::fs::symlink_metadata(&t).unwrap_or_else(|e| panic!("{}: {e}", t.display()));
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&md.file_type()));
    assert_eq!(md.permissions().mode() & 0o777, 0o600);
    let admin = std::fs::symlink_metadata(admin_dir_of(&sock)).unwrap();
    assert!(admin.is_dir());
    assert_eq!(admin.permissions().mode() & 0o7777, 0o700);
}

/// The uid the daemon runs as in the uid tests (a service user, not root).
const SERVICE_UID: u32 = 64010;

/// A daemon running as [`SERVICE_UID`] in a socket directory of its own.
fn start_as_service_user(tag: &str) -> Daemon {
    let dir = temp_dir(tag);
    std::os::unix::fs::chown(&dir, Some(SERVICE_UID), Some(SERVICE_UID)).unwrap();
    let socket = dir.join("kvnode.sock");
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    let child = kvnode_cmd()
        .uid(SERVICE_UID)
        .gid(SERVICE_UID)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(ARGS)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let d = Daemon { child, socket, dir };
    d.wait_ready(Duration::from_secs(10));
    d
}

/// Where the attacker finds the takeover socket of the daemon on `sock`: its default place,
/// or next to the client socket (where builds before issue 38 put it: the test then shows
/// the attack succeeding there).
fn find_takeover_socket(sock: &Path) -> PathBuf {
    let t = takeover_socket_of(sock);
    if t.exists() {
        return t;
    }
    let mut old = sock.as_os_str().to_owned();
    old.push(".takeover");
    PathBuf::from(old)
}

/// Connects to `path` as this process, asks for the tier, and reads until the other end
/// closes (at most 5 s): the bytes and the descriptors received.
fn steal(path: &Path) -> (Vec<u8>, usize) {
    let Ok(mut s) = UnixStream::connect(path) else {
        return (Vec::new(), 0);
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(ask().as_bytes());
    let (mut bytes, mut fds) = (Vec::new(), std::collections::VecDeque::new());
    let mut buf = [0u8; 4096];
    while fds.is_empty() {
        match kvnode_fdpass::recv_with_fds(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            &mut buf,
            &mut fds,
            4,
        ) {
            Ok(0) | Err(_) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
        }
    }
    (bytes, fds.len())
}

#[test]
fn neither_root_nor_another_uid_gets_the_arena_from_a_service_users_takeover_socket() {
    if !prerequisite(
        "root",
        not_root("the daemon runs as uid 64010, the attacker as root"),
    ) {
        return;
    }
    let mut d = start_as_service_user("takeover-uid");
    let ns = seed(&d);
    let pid = d.client().stats().unwrap().pid;
    let path = find_takeover_socket(&d.socket);
    // Another uid: the directory (0700) and the socket (0600) keep it out.
    let other = Command::new("/usr/bin/python3")
        .args(["-c", "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); s.sendall(sys.argv[2].encode()); s.settimeout(5)\n m,f,_,_=socket.recv_fds(s,65536,4); print('got',len(m),'bytes',len(f),'fds')\nexcept Exception as e:\n print('refused',type(e).__name__)"])
        .arg(&path)
        .arg(ask())
        .uid(64011)
        .gid(64011)
        .output()
        .unwrap();
    let other = String::from_utf8_lossy(&other.stdout);
    assert!(
        other.starts_with("refused") || other.starts_with("got 0 bytes 0 fds"),
        "uid 64011 on {}: {other}",
        path.display()
    );
    // Root that is not the daemon's uid (an engine container's default user): let through
    // the directory and the socket's mode by DAC override, stopped by the uid check.
    let (bytes, fds) = steal(&path);
    assert_eq!(
        fds,
        0,
        "root received the arena memfd from {} after {:?}",
        path.display(),
        String::from_utf8_lossy(&bytes)
    );
    assert!(
        bytes.is_empty(),
        "root was answered: {:?}",
        String::from_utf8_lossy(&bytes)
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        d.wait_exit(Duration::from_millis(10)).is_none(),
        "the daemon exited:\n{}",
        d.log()
    );
    d.wait_ready(Duration::from_secs(5));
    assert_eq!(d.client().stats().unwrap().pid, pid);
    assert_eq!(intact(&d, ns), 16);
}

/// What the script printed, after killing it (one that may never have been connected to).
fn killed_output(mut child: Script) -> String {
    let _ = child.0.kill();
    let _ = child.0.wait();
    let mut s = String::new();
    let _ = child.0.stdout.take().unwrap().read_to_string(&mut s);
    s
}

#[test]
fn a_service_user_successor_refuses_a_root_donor() {
    if !prerequisite(
        "root",
        not_root("the successor runs as uid 64010, the impostor as root"),
    ) {
        return;
    }
    let dir = temp_dir("takeover-root-donor");
    std::os::unix::fs::chown(&dir, Some(SERVICE_UID), Some(SERVICE_UID)).unwrap();
    let sock = dir.join("kvnode.sock");
    let admin = admin_dir_of(&sock);
    std::fs::create_dir_all(&admin).unwrap();
    std::fs::set_permissions(&admin, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&admin, Some(SERVICE_UID), Some(SERVICE_UID)).unwrap();
    // Root impostors, their sockets open to all: at the takeover socket, and next to the
    // client socket, where builds before issue 38 looked (showing them accepting root).
    let legacy_path = dir.join("kvnode.sock.takeover");
    let impostor = python(0, &takeover_socket_of(&sock), "silent");
    let legacy = python(0, &legacy_path, "silent");
    for p in [takeover_socket_of(&sock), legacy_path] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let mut cmd = kvnode_cmd();
    cmd.uid(SERVICE_UID).gid(SERVICE_UID);
    let mut args = ARGS.to_vec();
    args.push("--takeover");
    let (ok, text) = run_cmd_to_exit(cmd, &sock, &args, Duration::from_secs(20));
    let seen = (killed_output(impostor), killed_output(legacy));
    let _ = std::fs::remove_dir_all(&admin);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !seen.1.contains("got "),
        "the root impostor next to the client socket was asked: {}",
        seen.1
    );
    assert!(!ok, "{text}");
    assert!(text.contains("runs as uid 0"), "{text}");
    assert!(
        !seen.0.contains("got ") || seen.0.contains("got 0"),
        "the root impostor was sent: {}",
        seen.0
    );
}
