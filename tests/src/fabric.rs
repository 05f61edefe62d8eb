//! A small switched network of network namespaces for multi-node tests, and a real etcd on
//! it: a hub namespace holds a bridge (`10.S.0.254`, where etcd listens) and one veth port
//! per node namespace (`10.S.0.I` on the node's `eth0`). Everything is deleted on drop.
//! Taking a node's port down on the hub cuts it off like a pulled cable: nothing answers,
//! nothing resets (the kernel here has no `sch_netem`, so `tc netem loss` is not available).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn ip(args: &[&str]) -> Result<(), String> {
    crate::netns::ip(args).map(drop)
}

/// The namespaces and links.
#[derive(Debug)]
pub struct Fabric {
    /// Hub namespace (bridge, etcd).
    pub hub: String,
    /// Node namespaces, index 0 = node 1.
    pub nodes: Vec<String>,
    subnet: u8,
}

impl Fabric {
    /// `n` node namespaces on subnet `10.subnet.0.0/24`; `tag` keeps parallel tests apart.
    pub fn create(tag: &str, subnet: u8, n: usize) -> Result<Self, String> {
        let pid = std::process::id();
        let f = Self {
            hub: format!("kvc-{tag}-hub-{pid}"),
            nodes: (1..=n).map(|i| format!("kvc-{tag}-n{i}-{pid}")).collect(),
            subnet,
        };
        ip(&["netns", "add", &f.hub])?;
        ip(&["-n", &f.hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            &f.hub,
            "addr",
            "add",
            &format!("{}/24", f.etcd_ip()),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &f.hub, "link", "set", "br0", "up"])?;
        ip(&["-n", &f.hub, "link", "set", "lo", "up"])?;
        for (i, ns) in f.nodes.iter().enumerate() {
            let port = format!("p{}", i + 1);
            ip(&["netns", "add", ns])?;
            ip(&[
                "-n", &f.hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ])?;
            ip(&["-n", &f.hub, "link", "set", &port, "master", "br0", "up"])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", f.node_ip(i + 1)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(f)
    }

    /// Address of etcd (the hub's bridge).
    pub fn etcd_ip(&self) -> String {
        format!("10.{}.0.254", self.subnet)
    }

    /// Address of node `i` (1-based).
    pub fn node_ip(&self, i: usize) -> String {
        format!("10.{}.0.{i}", self.subnet)
    }

    /// Namespace of node `i` (1-based).
    pub fn ns(&self, i: usize) -> &str {
        &self.nodes[i - 1]
    }

    /// Cuts node `i` off (its switch port goes down) or reconnects it.
    pub fn set_connected(&self, i: usize, up: bool) {
        let port = format!("p{i}");
        ip(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &port,
            if up { "up" } else { "down" },
        ])
        .expect("switching a node's port");
    }

    /// Runs `f` on a thread that joined namespace `ns`'s network (sockets it opens live there).
    pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(format!("/var/run/netns/{ns}")).expect("netns file");
                // SAFETY: setns on this thread only, with a namespace file descriptor we hold.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(
                    rc,
                    0,
                    "setns into {ns}: {}",
                    std::io::Error::last_os_error()
                );
                f()
            })
            .join()
            .expect("thread in netns")
        })
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for ns in self.nodes.iter().chain(std::iter::once(&self.hub)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// A single-member etcd serving `http://ETCD_IP:2379` inside the hub namespace.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    hub: String,
    ip: String,
    /// Its data directory.
    pub data: PathBuf,
    log: PathBuf,
}

impl Etcd {
    /// Starts etcd in `fabric`'s hub with an empty data directory; waits until it answers.
    pub fn start(fabric: &Fabric, dir: &std::path::Path) -> Self {
        let mut e = Self {
            child: None,
            hub: fabric.hub.clone(),
            ip: fabric.etcd_ip(),
            data: dir.join("etcd-data"),
            log: dir.join("etcd.log"),
        };
        e.restart(true);
        e
    }

    /// `http://IP:2379`.
    pub fn client_url(&self) -> String {
        format!("http://{}:2379", self.ip)
    }

    /// Kills it (SIGKILL: no goodbye to its clients).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again, with its old data or (`wipe`) an empty data directory.
    pub fn restart(&mut self, wipe: bool) {
        self.restart_with(wipe, &[]);
    }

    /// Starts it again with extra flags. With `--cert-file` among them it serves
    /// `https://`; readiness is then read from its log (the gateway check speaks plain HTTP).
    pub fn restart_with(&mut self, wipe: bool, extra: &[String]) {
        let tls = extra.iter().any(|a| a == "--cert-file");
        let ready_before = self.log().matches("ready to serve client requests").count();
        self.kill();
        if wipe {
            let _ = std::fs::remove_dir_all(&self.data);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("etcd log");
        let url = if tls {
            self.client_url().replace("http://", "https://")
        } else {
            self.client_url()
        };
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.hub,
                "etcd",
                "--name",
                "e2e",
                "--data-dir",
            ])
            .arg(&self.data)
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "e2e=http://127.0.0.1:2380",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            let ready = if tls {
                self.log().matches("ready to serve client requests").count() > ready_before
            } else {
                self.http("GET", "/health", "")
                    .is_ok_and(|b| b.contains("true"))
            };
            if ready {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("etcd did not answer in 20 s; log:\n{}", self.log());
    }

    /// Its log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One HTTP/1.1 request to etcd's JSON gateway (from inside the hub); the body.
    pub fn http(&self, method: &str, path: &str, body: &str) -> Result<String, String> {
        http(&self.hub, &format!("{}:2379", self.ip), method, path, body)
    }

    /// A JSON request to the gateway that must succeed (auth set-up).
    pub fn call(&self, path: &str, body: &str) {
        let r = self
            .http("POST", path, body)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!r.contains("\"error\""), "{path} {body}: {r}");
    }

    /// Writes `key = value` (no lease) through the gateway.
    pub fn put(&self, key: &str, value: &str) -> Result<String, String> {
        let body = format!(
            r#"{{"key":"{}","value":"{}"}}"#,
            base64(key.as_bytes()),
            base64(value.as_bytes())
        );
        self.http("POST", "/v3/kv/put", &body)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One HTTP/1.1 request to `addr` from inside namespace `ns`; the response body.
pub fn http(ns: &str, addr: &str, method: &str, path: &str, body: &str) -> Result<String, String> {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    Fabric::in_netns(ns, || {
        let sa = addr.parse().map_err(|e| format!("{e}"))?;
        let mut s = std::net::TcpStream::connect_timeout(&sa, Duration::from_millis(500))
            .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| e.to_string())?;
        s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
        let mut out = String::new();
        s.read_to_string(&mut out).map_err(|e| e.to_string())?;
        Ok(out
            .split_once("\r\n\r\n")
            .map_or(out.clone(), |(_, b)| b.to_owned()))
    })
}

/// Standard base64 (the gateway's encoding of keys and values).
pub fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
        ] {
            assert_eq!(super::base64(i.as_bytes()), o);
        }
    }
}
