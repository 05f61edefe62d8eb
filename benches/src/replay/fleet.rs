//! The daemons of one arm: one per node (one per engine in the private arm) on loopback,
//! each with its own unix socket and KV event endpoint, and for the pulls arm a peer
//! listener that every other daemon may pull from. Dropping the fleet stops them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvnode_client::Client;

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
    peer_args: Vec<String>,
    peer: Option<String>,
}

fn spawn(s: Spawn<'_>) -> anyhow::Result<Daemon> {
    std::fs::create_dir_all(&s.dir)?;
    let sock = s.dir.join("kvnode.sock");
    let events = format!("ipc://{}", s.dir.join("events.sock").display());
    let config = s.dir.join("kvnode.toml");
    // The policy goes through the config file, so any `PolicyKind` the daemon knows works.
    std::fs::write(&config, format!("eviction = \"{}\"\n", s.policy))?;
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
        .args(&s.peer_args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(s.dir.join("log"))?)
        .spawn()
        .context("starting a daemon")?;
    let d = Daemon {
        child,
        dir: s.dir,
        sock,
        events,
        peer: s.peer,
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
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
    let endpoints: Vec<String> = ports
        .iter()
        .map(|p| format!("tcp://127.0.0.1:{p}"))
        .collect();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (peer_args, peer) = if arm == Arm::Pulls && n > 1 {
            let others: Vec<&str> = (0..n)
                .filter(|&j| j != i)
                .map(|j| endpoints[j].as_str())
                .collect();
            let args = vec![
                "--peer-listen".into(),
                format!("127.0.0.1:{}", ports[i]),
                "--advertise".into(),
                endpoints[i].clone(),
                "--peers".into(),
                others.join(","),
                // Loopback only; a keyless listener must be declared as such.
                "--peer-keyless-serves-every-local-user".into(),
            ];
            (args, Some(endpoints[i].clone()))
        } else {
            (Vec::new(), None)
        };
        out.push(spawn(Spawn {
            dir: base.join(format!("{arm:?}-{i}")),
            blocks: blocks as u64,
            block: setup.block_bytes,
            policy,
            peer_args,
            peer,
        })?);
    }
    Ok(out)
}
