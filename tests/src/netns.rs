//! Two network namespaces joined by one veth pair, for tests of daemons on separate
//! "hosts" (root and iproute2 only; see [`crate::netns_prerequisites`]).

use std::process::Command;

/// The source side's address.
pub const SRC_IP: &str = "10.77.0.1";

/// Runs `PROGRAM ARGS`: its stdout, or what failed (naming the command).
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("running {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<String, String> {
    run("ip", args)
}

/// Two namespaces `a` (source side, `va` = 10.77.0.1) and `b` (`vb` = 10.77.0.2), joined
/// by one veth pair; deleted on drop (which also deletes the pair).
#[derive(Debug)]
pub struct Namespaces {
    /// The source side (`va` = [`SRC_IP`]).
    pub a: String,
    /// The other side (10.77.0.2).
    pub b: String,
    vb: String,
    va: String,
}

impl Namespaces {
    /// Creates both namespaces and the pair (root only).
    pub fn create() -> Result<Self, String> {
        let pid = std::process::id();
        let n = Self {
            a: format!("kvnode-e2e-a-{pid}"),
            b: format!("kvnode-e2e-b-{pid}"),
            vb: format!("kvb{pid}"),
            va: format!("kva{pid}"),
        };
        let va = n.va.clone();
        ip(&["netns", "add", &n.a])?;
        ip(&["netns", "add", &n.b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &n.vb])?;
        ip(&["link", "set", &va, "netns", &n.a])?;
        ip(&["link", "set", &n.vb, "netns", &n.b])?;
        ip(&[
            "-n",
            &n.a,
            "addr",
            "add",
            &format!("{SRC_IP}/24"),
            "dev",
            &va,
        ])?;
        ip(&["-n", &n.b, "addr", "add", "10.77.0.2/24", "dev", &n.vb])?;
        for (ns, dev) in [(&n.a, &va), (&n.b, &n.vb)] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(n)
    }

    /// Bytes received on `b`'s end of the pair.
    pub fn rx_bytes_b(&self) -> u64 {
        let p = format!("/sys/class/net/{}/statistics/rx_bytes", self.vb);
        let out = Command::new("ip")
            .args(["netns", "exec", &self.b, "cat", &p])
            .output()
            .expect("read veth counters");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("rx_bytes is a number")
    }
}

impl Namespaces {
    /// Limits what `a` sends to `b` to `bits_per_s` (a `tc` token bucket on `a`'s end of the
    /// pair); `None` removes the limit.
    pub fn shape_a_to_b(&self, bits_per_s: Option<u64>) -> Result<(), String> {
        let tc = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &self.a, "tc"];
            all.extend_from_slice(args);
            ip(&all).map(drop)
        };
        let _ = tc(&["qdisc", "del", "dev", &self.va, "root"]);
        match bits_per_s {
            None => Ok(()),
            Some(r) => tc(&[
                "qdisc",
                "add",
                "dev",
                &self.va,
                "root",
                "tbf",
                "rate",
                &format!("{r}bit"),
                "burst",
                "32kb",
                "latency",
                "2s",
            ]),
        }
    }
}

impl Namespaces {
    /// A source daemon in `a` serving peers on [`SRC_IP`]:`port` and a destination in `b`
    /// allowed to pull from it, both with the cluster key in `key_file`, `dram` each, plus
    /// `dst_extra` flags for the destination: (source, destination).
    pub fn keyed_pair(
        &self,
        port: u16,
        key_file: &std::path::Path,
        dram: &str,
        dst_extra: &[&str],
    ) -> (crate::Daemon, crate::Daemon) {
        let key = key_file.to_str().expect("utf8 key path");
        let endpoint = format!("tcp://{SRC_IP}:{port}");
        let listen = format!("{SRC_IP}:{port}");
        let src = crate::Daemon::start_in_netns(
            &self.a,
            &[
                "--dram",
                dram,
                "--no-pin",
                "--peer-listen",
                &listen,
                "--advertise",
                &endpoint,
                "--cluster-key",
                key,
            ],
        );
        let mut args = vec![
            "--dram",
            dram,
            "--no-pin",
            "--cluster-key",
            key,
            "--peers",
            &endpoint,
        ];
        args.extend_from_slice(dst_extra);
        let dst = crate::Daemon::start_in_netns(&self.b, &args);
        (src, dst)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}
