//! The daemons of one arm: one per node (one per engine in the private arm) on loopback,
//! each with its own unix socket and KV event endpoint, and for the pulls arm a peer
//! listener that every other daemon may pull from, authenticated with a cluster key made for
//! the run, and a router entry (`--router-listen`, signed with the key's router key) that the
//! replay's router sends `--prefetch-at placement` prefetches to. Dropping the fleet stops
//! them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvnode_client::Client;
use kvnode_client::router::RouterEntry;

use super::config::{Arm, Setup, slab_bytes};

/// A daemon the replay started; killed and its directory removed on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    dir: PathBuf,
    /// Client socket.
    pub sock: PathBuf,
    /// KV event endpoint (`ipc://...`).
    pub events: String,
    /// Peer endpoint (`tcp://127.0.0.1:PORT`) in the pulls arm.
    pub peer: Option<String>,
    /// Its router entry in the pulls arm.
    pub router: Option<RouterEntry>,
}

impl Daemon {
    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What one daemon is started with.
struct Spawn<'a> {
    dir: PathBuf,
    blocks: u64,
    block: u64,
    policy: &'a str,
    /// The pulls arm's peer and router-entry settings.
    pulls: Option<Pulls>,
}

/// One pulls-arm daemon's peer listener, its peers, and its router entry.
struct Pulls {
    listen: u16,
    peers: Vec<String>,
    router: u16,
    cluster_key: String,
}

impl Pulls {
    /// The daemon's flags; writes the cluster key file (mode 0600) into `dir`.
    fn args(&self, dir: &Path) -> anyhow::Result<Vec<String>> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let key = dir.join("cluster.key");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key)
            .and_then(|mut f| writeln!(f, "{}", self.cluster_key))
            .with_context(|| format!("writing {}", key.display()))?;
        Ok(vec![
            "--peer-listen".into(),
            format!("127.0.0.1:{}", self.listen),
            "--advertise".into(),
            format!("tcp://127.0.0.1:{}", self.listen),
            "--peers".into(),
            self.peers.join(","),
            "--cluster-key".into(),
            key.display().to_string(),
            "--router-listen".into(),
            format!("127.0.0.1:{}", self.router),
        ])
    }
}

/// A cluster key for one run: 32 random bytes as hex, from the kernel.
fn fresh_cluster_key() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom for the run's cluster key")?;
    Ok(kvnode_proto::key::encode_hex(&b))
}

fn spawn(s: Spawn<'_>) -> anyhow::Result<Daemon> {
    std::fs::create_dir_all(&s.dir)?;
    let sock = s.dir.join("kvnode.sock");
    let events = format!("ipc://{}", s.dir.join("events.sock").display());
    let config = s.dir.join("kvnode.toml");
    // The policy goes through the config file, so any `PolicyKind` the daemon knows works.
    std::fs::write(&config, format!("eviction = \"{}\"\n", s.policy))?;
    let peer_args = match &s.pulls {
        Some(p) => p.args(&s.dir)?,
        None => Vec::new(),
    };
    let child = Command::new(std::env::current_exe()?)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .args(["--no-pin", "--no-populate", "--dram"])
        .arg((s.blocks * s.block).to_string())
        .arg("--slab-size")
        .arg(slab_bytes(s.blocks, s.block).to_string())
        .args(["--events", &events, "--socket"])
        .arg(&sock)
        .args(&peer_args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(s.dir.join("log"))?)
        .spawn()
        .context("starting a daemon")?;
    let d = Daemon {
        child,
        dir: s.dir,
        sock,
        events,
        peer: s
            .pulls
            .as_ref()
            .map(|p| format!("tcp://127.0.0.1:{}", p.listen)),
        router: s.pulls.as_ref().map(|p| {
            let key = kvnode_proto::router::router_key(p.cluster_key.as_bytes());
            RouterEntry::new(format!("127.0.0.1:{}", p.router), key)
        }),
    };
    wait_ready(&d.sock, &d)?;
    Ok(d)
}

fn wait_ready(sock: &Path, d: &Daemon) -> anyhow::Result<()> {
    let t = Instant::now();
    while Client::connect(sock).is_err() {
        if t.elapsed() > Duration::from_secs(20) {
            bail!("a replay daemon did not start; its log:\n{}", d.log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Starts the daemons of `arm` (none for the GPU arm).
pub fn start(setup: &Setup, arm: Arm, policy: &str) -> anyhow::Result<Vec<Daemon>> {
    let (n, blocks) = setup.caches(arm);
    let base = std::env::temp_dir().join(format!("kvnode-replay-{}", std::process::id()));
    let pulls = arm == Arm::Pulls && n > 1;
    let ports: Vec<[u16; 2]> = (0..n)
        .map(|_| Ok([free_port()?, free_port()?]))
        .collect::<anyhow::Result<_>>()?;
    let cluster_key = if pulls {
        fresh_cluster_key()?
    } else {
        String::new()
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let pulls = pulls.then(|| Pulls {
            listen: ports[i][0],
            peers: (0..n)
                .filter(|&j| j != i)
                .map(|j| format!("tcp://127.0.0.1:{}", ports[j][0]))
                .collect(),
            router: ports[i][1],
            cluster_key: cluster_key.clone(),
        });
        out.push(spawn(Spawn {
            dir: base.join(format!("{arm:?}-{i}")),
            blocks: blocks as u64,
            block: setup.block_bytes,
            policy,
            pulls,
        })?);
    }
    Ok(out)
}
