//! How many connections a pull from one peer is striped over, when the configuration leaves
//! it to the daemon (`[peer] connections = 0`, the default).
//!
//! Each connection of a pull costs about one core at the destination (receive, and BLAKE3
//! of every byte) and about half a core at the source, and moves 2.5–3.5 GB/s verified
//! (docs/benchmarks.md, "Peer pulls on a 16-core host"). So the count follows the cores,
//! keeping three quarters of them for the engine ranks that share the node, and stops where
//! the fastest network link is full. The choice and its basis are in `stats`.

use std::path::Path;

/// Most connections ever chosen (the configured limit is 64).
const MOST: u32 = 16;

/// Cores per connection: one in four cores may receive and verify pulls.
const CORES_PER_CONN: u32 = 4;

/// Verified bytes one connection moves, in Mb/s (2.5 GB/s, the low end measured).
const CONN_MBPS: u64 = 20_000;

/// The connection count in force and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnChoice {
    /// Connections per peer.
    pub n: u32,
    /// `configured`, or what the automatic choice was based on.
    pub basis: String,
}

/// `configured` when it is non-zero; otherwise the choice for this host's cores and the
/// fastest link under `/sys/class/net`.
pub fn choose(configured: u32) -> ConnChoice {
    if configured > 0 {
        return ConnChoice {
            n: configured,
            basis: "configured".into(),
        };
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    auto(cores, fastest_link_mbps(Path::new("/sys/class/net")))
}

/// The automatic choice for `cores` and a link of `link_mbps` (`None`: no link speed known,
/// e.g. only loopback or virtual interfaces).
pub fn auto(cores: u32, link_mbps: Option<u64>) -> ConnChoice {
    let by_cores = cores.div_ceil(CORES_PER_CONN).clamp(1, MOST);
    match link_mbps {
        Some(l) => {
            let by_link = u32::try_from(l.div_ceil(CONN_MBPS))
                .unwrap_or(MOST)
                .clamp(1, MOST);
            ConnChoice {
                n: by_cores.min(by_link),
                basis: format!("auto: {cores} cores, fastest link {} Gb/s", l / 1000),
            }
        }
        None => ConnChoice {
            n: by_cores,
            basis: format!("auto: {cores} cores, no link speed known"),
        },
    }
}

/// The highest `speed` (Mb/s) of an interface that is up, `lo` excluded. Virtual interfaces
/// report no speed (reading fails or gives -1) and are skipped.
fn fastest_link_mbps(net: &Path) -> Option<u64> {
    let dir = std::fs::read_dir(net).ok()?;
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name() != "lo")
        .filter(|e| {
            std::fs::read_to_string(e.path().join("operstate")).is_ok_and(|s| s.trim() == "up")
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("speed")).ok())
        .filter_map(|s| s.trim().parse::<i64>().ok())
        .filter_map(|s| u64::try_from(s).ok().filter(|&s| s > 0))
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_cores_and_stops_at_the_link() {
        assert_eq!(auto(2, None).n, 1);
        assert_eq!(auto(16, None).n, 4);
        assert_eq!(auto(128, None).n, 16);
        // A 25 Gb/s NIC is full with two connections, a 400 Gb/s one needs the cores' 16.
        assert_eq!(auto(64, Some(25_000)).n, 2);
        assert_eq!(auto(64, Some(400_000)).n, 16);
        assert_eq!(auto(1, Some(400_000)).n, 1);
        assert_eq!(auto(16, Some(100)).n, 1);
        assert!(auto(16, Some(100_000)).basis.contains("100 Gb/s"));
        assert_eq!(choose(3).n, 3);
        assert_eq!(choose(3).basis, "configured");
        let c = choose(0);
        assert!(
            (1..=MOST).contains(&c.n) && c.basis.starts_with("auto"),
            "{c:?}"
        );
    }

    #[test]
    fn reads_the_fastest_interface_that_is_up() {
        let d = std::env::temp_dir().join(format!("kvnode-conns-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        let iface = |name: &str, state: &str, speed: &str| {
            let p = d.join(name);
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("operstate"), format!("{state}\n")).unwrap();
            std::fs::write(p.join("speed"), format!("{speed}\n")).unwrap();
        };
        iface("lo", "unknown", "-1");
        assert_eq!(fastest_link_mbps(&d), None);
        iface("eth0", "up", "25000");
        iface("eth1", "down", "400000");
        iface("veth0", "up", "-1");
        iface("bond0", "up", "garbage");
        assert_eq!(fastest_link_mbps(&d), Some(25_000));
        iface("ib0", "up", "200000");
        assert_eq!(fastest_link_mbps(&d), Some(200_000));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
