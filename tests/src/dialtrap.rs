//! Evidence that a daemon in a [`Fabric`] never dialled an endpoint, seen from outside the
//! daemon instead of inferred from its report (`op.peer` is `None` only says the op did not
//! record a peer). A [`DialTrap`] armed before the hinted request watches the endpoint two
//! ways:
//!
//! - a listener bound at the endpoint in the target node's namespace, when nothing holds that
//!   address (a SIGKILLed member's old port, a port no member listens on): any dial there
//!   completes a connection the listener would accept;
//! - always, a counter of TCP SYNs leaving the dialling node's namespace for the endpoint (an
//!   iptables `OUTPUT` rule with a comment of its own, removed on drop). It also sees a dial
//!   to an address a live daemon holds, or to a node cut off by a partition, where no listener
//!   can be bound or reached.
//!
//! Needs root and iptables (scripts/install-deps.sh), as the fabric does.

use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::fabric::Fabric;

/// How long a dial started by the refused request is given to show up before the check.
const GRACE: Duration = Duration::from_millis(200);

/// A watch on one endpoint (see the module doc); removes its iptables rule on drop.
#[derive(Debug)]
pub struct DialTrap {
    /// The dialling node's namespace, where the SYN counter lives.
    from_ns: String,
    /// `ip:port` watched.
    addr: String,
    /// The rule's comment, unique in this process.
    tag: String,
    /// The listener at the endpoint, when the address was free.
    listener: Option<TcpListener>,
}

fn iptables(ns: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "iptables", "-w"])
        .args(args)
        .output()
        .map_err(|e| format!("running iptables in {ns}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "iptables {} in {ns}: {} (Debian: iptables; scripts/install-deps.sh)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl DialTrap {
    /// Watches `ip:port` of node `to` for dials from node `from` (1-based node numbers).
    pub fn arm(fabric: &Fabric, from: usize, to: usize, port: u16) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let ip = fabric.node_ip(to);
        let addr = format!("{ip}:{port}");
        let tag = format!(
            "kvnode-dialtrap-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let from_ns = fabric.ns(from).to_owned();
        let port_s = port.to_string();
        let rule = [
            "-p",
            "tcp",
            "--syn",
            "-d",
            &ip,
            "--dport",
            &port_s,
            "-m",
            "comment",
            "--comment",
            &tag,
            "-j",
            "ACCEPT",
        ];
        iptables(&from_ns, &[&["-I", "OUTPUT"][..], &rule].concat()).expect("arm the SYN counter");
        let listener = Fabric::in_netns(fabric.ns(to), || TcpListener::bind(addr.as_str())).ok();
        if let Some(l) = &listener {
            l.set_nonblocking(true).expect("nonblocking trap listener");
        }
        Self {
            from_ns,
            addr,
            tag,
            listener,
        }
    }

    /// SYNs counted so far.
    fn syns(&self) -> u64 {
        let table =
            iptables(&self.from_ns, &["-L", "OUTPUT", "-v", "-n", "-x"]).expect("read counters");
        let line = table
            .lines()
            .find(|l| l.contains(&self.tag))
            .unwrap_or_else(|| panic!("the trap's rule {} is gone:\n{table}", self.tag));
        line.split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no packet count in {line:?}"))
    }

    /// Asserts that nothing dialled the endpoint: no SYN left the dialling namespace for it
    /// and (where bound) the listener has no connection waiting. `what` names the request.
    pub fn assert_never_dialled(&self, what: &str) {
        std::thread::sleep(GRACE);
        let syns = self.syns();
        let accepted = match &self.listener {
            None => "no listener (the address is held or cut off)".to_owned(),
            Some(l) => match l.accept() {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => "nothing".to_owned(),
                other => format!("{other:?}"),
            },
        };
        assert!(
            syns == 0 && !accepted.starts_with("Ok"),
            "{what}: {} was dialled: {syns} SYNs sent to it; its listener accepted {accepted}",
            self.addr
        );
    }
}

impl Drop for DialTrap {
    fn drop(&mut self) {
        let table = iptables(&self.from_ns, &["-L", "OUTPUT", "--line-numbers", "-n"]);
        let Ok(table) = table else { return };
        if let Some(n) = table
            .lines()
            .find(|l| l.contains(&self.tag))
            .and_then(|l| l.split_whitespace().next())
        {
            let _ = iptables(&self.from_ns, &["-D", "OUTPUT", n]);
        }
    }
}
