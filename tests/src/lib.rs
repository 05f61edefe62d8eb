//! Test harness: starts real `kvnode` daemon processes on private sockets and stops them.
//!
//! The `kvnode` binary is found next to the test executable (`target/<profile>/kvnode`);
//! `cargo test --workspace` builds it before running these tests.

pub mod dialtrap;
pub mod fabric;
pub mod keyless;
pub mod netns;
pub mod peerstats;
pub mod peerwire;
pub mod raw;
pub mod router;
pub mod shm;
pub mod snapshot;
pub mod throttle;
pub mod ucxforge;
pub mod ucxsteal;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_proto::{Digest, Key, NamespaceSpec};

/// Path of the `kvnode` binary built alongside the tests.
pub fn kvnode_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVNODE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .expect("deps dir")
        .parent()
        .expect("profile dir");
    let bin = dir.join("kvnode");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build --release -p kvnode` first",
        bin.display()
    );
    bin
}

/// The switch a daemon built with the test seams needs to serve (engine/daemon/src/seams.rs);
/// every daemon this harness starts gets it. A release daemon ignores it.
pub const SEAMS_SWITCH: (&str, &str) = ("KVNODE_TEST_SEAMS", "1");

/// `kvnode` ([`kvnode_bin`]) with [`SEAMS_SWITCH`] set: how tests start `kvnode serve`.
pub fn kvnode_cmd() -> Command {
    let mut c = Command::new(kvnode_bin());
    c.env(SEAMS_SWITCH.0, SEAMS_SWITCH.1);
    c
}

/// The directory of the takeover socket of a daemon serving `socket` by default
/// (`<socket dir>-admin`, `EngineConfig::takeover_path`).
pub fn admin_dir_of(socket: &Path) -> PathBuf {
    let dir = socket.parent().expect("socket has a directory");
    let mut name = dir.file_name().expect("socket dir has a name").to_owned();
    name.push("-admin");
    dir.with_file_name(name)
}

/// The default takeover socket of a daemon serving `socket`.
pub fn takeover_socket_of(socket: &Path) -> PathBuf {
    let mut name = socket.file_name().expect("socket has a name").to_owned();
    name.push(".takeover");
    admin_dir_of(socket).join(name)
}

/// Path of the `kvtrace` binary built alongside the tests (`KVTRACE_BIN` overrides).
pub fn kvtrace_bin() -> PathBuf {
    std::env::var_os("KVTRACE_BIN")
        .map_or_else(|| kvnode_bin().with_file_name("kvtrace"), PathBuf::from)
}

/// Environment variable that lets a test skip when a prerequisite is missing: a comma list
/// of the prerequisites that may be missing (`root`, `ip`, `gpu-driver`, `etcd`) or `all`. Unset,
/// as in CI, a missing prerequisite fails the test: nothing passes by skipping.
pub const ALLOW_SKIP_ENV: &str = "KVNODE_TEST_ALLOW_SKIP";

/// Whether a test may run: true when its prerequisite `what` is there (`missing` is `None`).
/// Otherwise panics with the reason, unless [`ALLOW_SKIP_ENV`] lists `what` (or `all`):
/// then it prints a loud skip notice and returns false.
pub fn prerequisite(what: &str, missing: Option<String>) -> bool {
    let Some(why) = missing else {
        return true;
    };
    let allowed = std::env::var(ALLOW_SKIP_ENV).unwrap_or_default();
    assert!(
        allowed
            .split(',')
            .any(|w| w.trim() == what || w.trim() == "all"),
        "prerequisite `{what}` missing: {why}. Provide it (CI runs as root with iproute2), or set {ALLOW_SKIP_ENV}={what} to skip this test on purpose"
    );
    eprintln!("\n!!!!! SKIPPING ({ALLOW_SKIP_ENV}={allowed}): {why} !!!!!\n");
    false
}

/// `Some(reason)` when this process is not root.
pub fn not_root(needs: &str) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } != 0).then(|| format!("not running as root: {needs}"))
}

/// `Some(reason)` when `tool` cannot be run (`tool probe` fails to start).
pub fn missing_tool(tool: &str, probe: &str, hint: &str) -> Option<String> {
    Command::new(tool)
        .arg(probe)
        .output()
        .is_err()
        .then(|| format!("`{tool}` is not installed ({hint})"))
}

/// Whether multi-namespace tests can run: root (network namespaces need CAP_NET_ADMIN),
/// iproute2, and each of `tools` (`(binary, probe argument, where it comes from)`); see
/// [`prerequisite`] for what happens when one is missing.
pub fn netns_prerequisites(tools: &[(&str, &str, &str)]) -> bool {
    prerequisite("root", not_root("network namespaces need CAP_NET_ADMIN"))
        && prerequisite("ip", missing_tool("ip", "-V", "Debian: iproute2"))
        && tools
            .iter()
            .all(|(t, probe, hint)| prerequisite(t, missing_tool(t, probe, hint)))
}

/// Whether BPF tests can run (root); see [`prerequisite`].
pub fn bpf_allowed() -> bool {
    prerequisite("root", not_root("kvtrace needs CAP_BPF + CAP_PERFMON"))
}

/// A fresh private directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kvnode-e2e-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(admin_dir_of(&d.join("kvnode.sock")));
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

/// Waits up to `limit` for `child` to exit: its status, or `None` if it still runs.
pub fn child_exit(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// `key value` lines (a probe binary's report) as a map.
pub fn key_values(stdout: &[u8]) -> std::collections::HashMap<String, String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The arguments of [`Daemon::start_roomy_spilling`]: a 64 MiB DRAM tier (2 MiB slabs,
/// unpinned) over a 128 MiB spill file in `dir`.
pub fn roomy_spilling_args(dir: &Path) -> Vec<&str> {
    vec![
        "--dram",
        "64MiB",
        "--slab-size",
        "2MiB",
        "--no-pin",
        "--spill-dir",
        dir.to_str().expect("utf8 spill dir"),
        "--spill-size",
        "128MiB",
    ]
}

/// A running daemon; killed on drop.
#[derive(Debug)]
pub struct Daemon {
    /// Child process.
    pub child: Child,
    /// Its socket.
    pub socket: PathBuf,
    /// Its private directory (log file `daemon.log`).
    pub dir: PathBuf,
}

impl Daemon {
    /// Starts `kvnode serve --socket <dir>/kvnode.sock <args>` and waits until it answers.
    pub fn start(args: &[&str]) -> Self {
        Self::spawn(kvnode_cmd(), args)
    }

    /// Like [`Daemon::start`], with extra environment variables.
    pub fn start_env(env: &[(&str, &str)], args: &[&str]) -> Self {
        let mut cmd = kvnode_cmd();
        cmd.envs(env.iter().copied());
        Self::spawn(cmd, args)
    }

    /// Runs `kvnode serve <args>` on a private socket expecting it to refuse to start:
    /// returns its exit status and log. Panics if it is still running after `limit`.
    pub fn start_failing(args: &[&str], limit: Duration) -> (ExitStatus, String) {
        let dir = temp_dir("daemon-fail");
        let log_path = dir.join("daemon.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut child = kvnode_cmd()
            .arg("serve")
            .arg("--socket")
            .arg(dir.join("kvnode.sock"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvnode");
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait for kvnode") {
                break s;
            }
            if t.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "kvnode serve {args:?} was expected to refuse to start but still runs after {limit:?}; log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(admin_dir_of(&dir.join("kvnode.sock")));
        (status, text)
    }

    /// A daemon whose small DRAM tier (16 MiB of 2 MiB slabs, unpinned) spills into `dir`
    /// (`spill_size` of it), plus `extra` arguments: demotion and promotion happen after a
    /// few blocks.
    pub fn start_spilling(dir: &Path, spill_size: &str, extra: &[&str]) -> Self {
        let args = spilling_args(dir, spill_size, extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start(&refs)
    }

    /// A daemon with a roomy DRAM tier (64 MiB: nothing is demoted by these tests' data) over
    /// a 128 MiB spill file in `dir`, plus `extra`.
    pub fn start_roomy_spilling(dir: &Path, extra: &[&str]) -> Self {
        let mut args = roomy_spilling_args(dir);
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    /// Like [`Daemon::start`], inside network namespace `netns` (`ip netns exec`, root only).
    /// Its Unix socket is a file, so clients outside the namespace still reach it.
    pub fn start_in_netns(netns: &str, args: &[&str]) -> Self {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns]).arg(kvnode_bin());
        Self::spawn(cmd, args)
    }

    /// Spawns `kvnode serve --socket <socket> <args>` without waiting for it to answer (a
    /// successor taking a running daemon's socket over: that one answers meanwhile). Its
    /// log is in its own private directory.
    pub fn spawn_at(socket: &Path, args: &[&str]) -> Self {
        Self::spawn_at_env(socket, &[], args)
    }

    /// Like [`Daemon::spawn_at`], with `env` set.
    pub fn spawn_at_env(socket: &Path, env: &[(&str, &str)], args: &[&str]) -> Self {
        let dir = temp_dir("daemon");
        let log = std::fs::File::create(dir.join("daemon.log")).expect("log file");
        let child = kvnode_cmd()
            .envs(env.iter().copied())
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvnode");
        Self {
            child,
            socket: socket.to_owned(),
            dir,
        }
    }

    /// Like [`Daemon::spawn_at`], then waits until it answers.
    pub fn start_at(socket: &Path, args: &[&str]) -> Self {
        let d = Self::spawn_at(socket, args);
        d.wait_ready(Duration::from_secs(10));
        d
    }

    /// Starts `cmd serve --socket <dir>/kvnode.sock <args>` (a prepared command: its own
    /// environment, umask or uid; [`SEAMS_SWITCH`] is added) and waits until it answers.
    pub fn spawn(mut cmd: Command, args: &[&str]) -> Self {
        let dir = temp_dir("daemon");
        let socket = dir.join("kvnode.sock");
        let log = std::fs::File::create(dir.join("daemon.log")).expect("log file");
        let child = cmd
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvnode");
        let d = Self { child, socket, dir };
        d.wait_ready(Duration::from_secs(10));
        d
    }

    /// Waits until a client can connect and the spill tier, if any, is recovered (a
    /// daemon serves from DRAM while it recovers: docs/operations.md, "Restart").
    pub fn wait_ready(&self, limit: Duration) -> Duration {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Ok(mut c) = Client::connect(&self.socket)
                && c.stats().map_or(true, |s| !s.spill_recovering)
            {
                return t.elapsed();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("daemon did not come up in {limit:?}; log:\n{}", self.log());
    }

    /// Waits until a client can connect (the spill tier may still be recovering).
    pub fn wait_answering(&self, limit: Duration) -> Duration {
        let t = Instant::now();
        while t.elapsed() < limit {
            if Client::connect(&self.socket).is_ok() {
                return t.elapsed();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("daemon did not answer in {limit:?}; log:\n{}", self.log());
    }

    /// A connected client.
    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(
                libc::pid_t::try_from(self.child.id()).expect("pid fits"),
                sig,
            )
        };
    }

    /// Sends SIGSTOP and waits until the kernel reports the process stopped (`T`), since
    /// delivery is asynchronous and a busy machine may let it run a while longer.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.child.id());
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            let s = std::fs::read_to_string(&stat).unwrap_or_default();
            if s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T'))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("daemon {} did not stop after SIGSTOP", self.child.id());
    }

    /// Waits for exit up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        child_exit(&mut self.child, limit)
    }

    /// Socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        // The takeover socket's directory, when the harness chose the socket (not spawn_at).
        if self.socket.parent() == Some(self.dir.as_path()) {
            let _ = std::fs::remove_dir_all(admin_dir_of(&self.socket));
        }
    }
}

/// A namespace spec with one segment of `slot` bytes.
pub fn spec(model: &str, slot: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: model.into(),
        page_size: 64,
        segments: vec![slot],
        ..NamespaceSpec::default()
    }
}

/// A reference namespace ("ref", 8 KiB slots) with 16 committed blocks whose bytes must
/// never change while a test throws bad input at the daemon: (client, ns, keys, bytes).
pub fn seed_blocks(d: &Daemon) -> (Client, u32, Vec<Key>, Vec<Vec<u8>>) {
    let mut c = d.client();
    let ns = c.register(&spec("ref", 8192)).expect("register ref").ns;
    let keys: Vec<Key> = (0..16).map(key).collect();
    let data: Vec<Vec<u8>> = (0..16).map(|i| block(i, 8192)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let res = c.put(ns, &keys, &refs).expect("put ref blocks");
    assert!(
        res.iter()
            .all(|s| *s == kvnode_proto::client::PutStatus::Stored),
        "{res:?}"
    );
    (c, ns, keys, data)
}

/// Every block of [`seed_blocks`] is still there with its bytes.
pub fn assert_unchanged(c: &mut Client, ns: u32, keys: &[Key], data: &[Vec<u8>]) {
    let got = c.get(ns, keys).expect("get ref blocks");
    for (i, (g, want)) in got.iter().zip(data).enumerate() {
        assert_eq!(g.as_deref(), Some(want.as_slice()), "reference block {i}");
    }
}

/// A distinct key per `i`.
pub fn key(i: u64) -> Key {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_be_bytes());
    d[31] = 0x5a;
    Key::page(Digest(d))
}

/// Deterministic bytes for block `i`.
pub fn block(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `kvnode stats` (human tables) against the daemon at `socket`.
pub fn stats_text(socket: &Path) -> String {
    let out = Command::new(kvnode_bin())
        .args(["stats", "--socket"])
        .arg(socket)
        .output()
        .expect("run kvnode stats");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A spill directory removed with everything in it when dropped (a test's spill files are
/// often a GiB: left behind, repeated runs fill the disk). Declare it before the daemons
/// that use it, so they stop first.
#[derive(Debug)]
pub struct SpillDir(PathBuf);

impl std::ops::Deref for SpillDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for SpillDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, empty spill directory under /var/tmp (real disk, not tmpfs: O_DIRECT needs it).
pub fn spill_dir(tag: &str) -> SpillDir {
    let d = PathBuf::from(format!("/var/tmp/kvnode-e2e-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("spill dir");
    SpillDir(d)
}

/// The stats of tier `name` (`"dram"`, `"nvme"`) from a live daemon.
pub fn tier(c: &mut Client, name: &str) -> kvnode_proto::stats::TierStats {
    c.stats()
        .unwrap()
        .tiers
        .into_iter()
        .find(|t| t.tier == name)
        .unwrap_or_else(|| panic!("no {name} tier in stats"))
}

/// A free loopback TCP port (bound then released).
///
/// The port is taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`). A
/// port from binding port 0 is free only until the kernel hands it out again, to any bind of
/// port 0 or any outgoing connection: a UCX transport listens on and dials from ephemeral
/// ports, and a daemon started after another found its peer port taken (`Address already in
/// use`, a `./dev test --fresh` run on 2026-12-07). The kernel never hands out a port below the
/// range; this process walks its own sequence of them (seeded by its pid) and returns the first
/// one nothing holds, never the same one twice.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let high = ephemeral_low().max(LOW + 2_000);
    let mut span = high - LOW;
    if span.is_multiple_of(7_919) {
        span -= 1;
    }
    let seed = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        // 7919 is prime and `span` not a multiple of it: the walk visits every port once.
        let port = LOW + (seed + n * 7_919) % span;
        let port = u16::try_from(port).expect("port below 65536");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{high}")
}

/// The first port of the kernel's ephemeral range (32768 where it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A compact router hint naming `tcp://127.0.0.1:port` for `keys`.
pub fn hint(port: u16, keys: &[Key]) -> String {
    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    format!(
        r#"{{"source_control_endpoint":"tcp://127.0.0.1:{port}","block_hashes":[{}]}}"#,
        hashes.join(",")
    )
}

/// The peer transport the peer suites run their daemons with: `tcp` (default) or `ucx`,
/// from `KVNODE_E2E_PEER_TRANSPORT` (CI runs the suites once per transport). With `ucx`,
/// daemons get [`UCX_SOFTWARE`] and `UCX_TLS=tcp` unless `UCX_TLS` is set.
pub fn peer_transport() -> &'static str {
    match std::env::var("KVNODE_E2E_PEER_TRANSPORT").as_deref() {
        Err(_) | Ok("" | "tcp") => "tcp",
        Ok("ucx") => "ucx",
        Ok(other) => panic!("KVNODE_E2E_PEER_TRANSPORT={other}: expected tcp or ucx"),
    }
}

/// The UCX transport over UCX's software RMA (its TCP transport on loopback, as the tests
/// run it: no RDMA device here), which a daemon accepts only with the explicit switch.
pub const UCX_SOFTWARE: [&str; 3] = [
    "--peer-transport",
    "ucx",
    "--peer-ucx-insecure-software-rma",
];

/// Starts a peer daemon with `args` on the suite's transport ([`peer_transport`]); with UCX
/// it checks that the daemon really runs it.
pub fn peer_daemon(args: &[&str]) -> Daemon {
    if peer_transport() == "tcp" {
        return Daemon::start(args);
    }
    let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into());
    let mut all = args.to_vec();
    all.extend_from_slice(&UCX_SOFTWARE);
    let d = Daemon::start_env(&[("UCX_TLS", tls.as_str())], &all);
    assert!(
        d.log().contains("transport ucx"),
        "daemon does not run the UCX transport:\n{}",
        d.log()
    );
    d
}

/// The flags of [`Daemon::start_spilling`]: a 16 MiB DRAM tier of 2 MiB slabs, unpinned,
/// spilling into `dir` (`spill_size` of it), plus `extra`.
pub fn spilling_args(dir: &Path, spill_size: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["--dram", "16MiB", "--slab-size", "2MiB", "--no-pin"]
        .map(str::to_owned)
        .to_vec();
    args.extend([
        "--spill-dir".to_owned(),
        dir.to_str().expect("utf8 spill dir").to_owned(),
    ]);
    args.extend(["--spill-size".to_owned(), spill_size.to_owned()]);
    args.extend(extra.iter().map(|&a| a.to_owned()));
    args
}

/// A spilling daemon ([`spilling_args`]) on the peer suites' transport ([`peer_daemon`]).
pub fn peer_spilling(dir: &Path, spill_size: &str, extra: &[&str]) -> Daemon {
    let args = spilling_args(dir, spill_size, extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    peer_daemon(&refs)
}

/// The flags of a source daemon serving peers on `127.0.0.1:port` (256 MiB DRAM, not
/// pinned, advertised as `tcp://127.0.0.1:port`), plus `extra`.
pub fn peer_source_args(port: u16, extra: &[&str]) -> Vec<String> {
    let listen = format!("127.0.0.1:{port}");
    let adv = format!("tcp://{listen}");
    let mut args: Vec<String> = ["--dram", "256MiB", "--no-pin", "--peer-listen"]
        .map(str::to_owned)
        .to_vec();
    args.extend([listen, "--advertise".to_owned(), adv]);
    if !extra.contains(&"--cluster-key") {
        args.push(KEYLESS.to_owned());
    }
    args.extend(extra.iter().map(|&a| a.to_owned()));
    args
}

/// The switch a peer listener without a cluster key needs (it serves every local user).
pub const KEYLESS: &str = "--peer-keyless-serves-every-local-user";

/// A source daemon serving peers on `127.0.0.1:port`, plus `extra` flags.
pub fn peer_source(port: u16, extra: &[&str]) -> Daemon {
    let args = peer_source_args(port, extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    peer_daemon(&refs)
}

/// A destination daemon allowed to pull from `peers`, plus `extra` flags.
pub fn peer_dest(peers: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--dram", "256MiB", "--no-pin", "--peers", peers];
    args.extend_from_slice(extra);
    peer_daemon(&args)
}

/// Puts blocks `0..n` (of `len` bytes, [`block`] contents) four per request, every one
/// stored, then waits (up to 20 s) until no demotion is in flight: with a small DRAM tier
/// most of them then live on NVMe only.
pub fn fill_and_settle(c: &mut Client, ns: u32, n: u64, len: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(4) {
        let keys: Vec<Key> = chunk.iter().map(|&i| key(i)).collect();
        let data: Vec<Vec<u8>> = chunk.iter().map(|&i| block(i, len)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let r = c.put(ns, &keys, &refs).expect("put");
        assert!(
            r.iter()
                .all(|s| *s == kvnode_proto::client::PutStatus::Stored),
            "{r:?}"
        );
    }
    let t0 = Instant::now();
    while tier(c, "dram").in_flight > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "demotions never finished"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The failure a keyed plaintext session on this CPU gives a changed block: the block MAC's
/// (POLYVAL, engine/core/src/peer/block_mac.rs) where the CPU has carry-less multiplies,
/// else BLAKE3's.
pub fn keyed_check() -> &'static str {
    if kvnode_engine::peer::block_mac::available() {
        "checksum mismatch (block MAC)"
    } else {
        "checksum mismatch (BLAKE3)"
    }
}

#[cfg(test)]
mod tests {
    use super::{ephemeral_low, free_port};
    use std::collections::HashSet;

    /// The daemons' peer ports must not be ones the kernel hands out to binds of port 0 and to
    /// outgoing connections (a UCX daemon took another's port: EADDRINUSE in a fresh run).
    #[test]
    fn free_ports_lie_below_the_ephemeral_range_and_never_repeat() {
        let low = ephemeral_low();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        assert!(
            ports.iter().all(|&p| u32::from(p) < low),
            "a port in the kernel's ephemeral range (from {low}): {ports:?}"
        );
        assert_eq!(ports.iter().collect::<HashSet<_>>().len(), ports.len());
    }
}
