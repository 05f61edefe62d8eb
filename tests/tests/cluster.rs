//! Cluster membership on a real etcd with real daemons, each in its own network namespace
//! on a switched test network (`kvnode_e2e::fabric`): hinted pulls between members with no
//! `--peers`; a SIGKILLed daemon leaves within its lease TTL and hints naming it are refused
//! before any dial (a `DialTrap` at the endpoint sees none: a listener where the address is
//! free, and a count of SYNs sent to it); a daemon back at a new address is accepted there only; a partitioned
//! node is dropped by the others and stops trusting its stale view after the grace; an etcd
//! outage keeps known members usable for the grace, then refuses, and everyone re-registers
//! when etcd is back (with its data wiped); a member with another peer protocol is listed
//! and refused. Needs root, iproute2 and Debian's `etcd-server`: without them it fails,
//! unless `KVNODE_TEST_ALLOW_SKIP=root,ip,etcd` says skipping is intended.
//! Run: `cargo build --release -p kvnode && cargo test --release -p kvnode-e2e --test cluster`.

use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::dialtrap::DialTrap;
use kvnode_e2e::fabric::{Etcd, Fabric};
use kvnode_e2e::{Daemon, block, key, kvnode_bin, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::cluster::{ClusterReport, ClusterState};
use kvnode_proto::pull::{FailCode, KeyOutcome, OpReport, OpState};

const BLOCK: usize = 64 << 10;
/// Blocks each daemon holds; every pull takes two fresh ones (a pulled block is then local).
const HELD: u64 = 40;
const TTL_S: u64 = 2;

fn runnable() -> bool {
    kvnode_e2e::netns_prerequisites(&[(
        "etcd",
        "--version",
        "Debian: etcd-server; scripts/install-deps.sh",
    )])
}

/// One test's cluster: its network, etcd, key file, and the fresh-key counters.
struct Cluster {
    fabric: Fabric,
    etcd: Option<Etcd>,
    dir: std::path::PathBuf,
    url: String,
    grace_s: u64,
    next: Vec<u64>,
}

impl Cluster {
    fn new(tag: &str, subnet: u8, grace_s: u64) -> Self {
        let fabric = Fabric::create(tag, subnet, 3).expect("building the test network");
        let dir = temp_dir(&format!("cluster-{tag}"));
        std::fs::write(
            dir.join("cluster.key"),
            "cluster-test-key-0123456789abcdef\n",
        )
        .unwrap();
        let url = format!("etcd://{}:2379/e2e-{tag}", fabric.etcd_ip());
        Self {
            fabric,
            etcd: None,
            dir,
            url,
            grace_s,
            next: vec![0; 4],
        }
    }

    fn endpoint(&self, i: usize, port: u16) -> String {
        format!("tcp://{}:{port}", self.fabric.node_ip(i))
    }

    /// Node `i` as a daemon listening on `port`, joined to the cluster as `n{i}`.
    fn start(&self, i: usize, port: u16) -> Daemon {
        let listen = format!("{}:{port}", self.fabric.node_ip(i));
        let key = self.dir.join("cluster.key");
        let (ttl, grace, id) = (TTL_S.to_string(), self.grace_s.to_string(), format!("n{i}"));
        let metrics = format!("{}:9100", self.fabric.node_ip(i));
        Daemon::start_in_netns(
            self.fabric.ns(i),
            &[
                "--dram",
                "48MiB",
                "--no-pin",
                "--peer-listen",
                &listen,
                "--cluster-key",
                key.to_str().unwrap(),
                "--cluster",
                &self.url,
                "--node-id",
                &id,
                "--cluster-ttl",
                &ttl,
                "--cluster-grace",
                &grace,
                "--metrics",
                &metrics,
            ],
        )
    }

    /// Two keys of node `i`'s blocks that no other daemon has pulled yet.
    fn fresh(&mut self, i: usize) -> Vec<Key> {
        let n = self.next[i];
        assert!(n + 2 <= HELD, "test ran out of fresh blocks of node {i}");
        self.next[i] += 2;
        (n..n + 2).map(|j| key(i as u64 * 10_000 + j)).collect()
    }
}

/// Stores node `i`'s blocks (again, after a restart).
fn seed(d: &Daemon, i: usize) {
    let mut c = d.client();
    let ns = c.register(&spec("cluster", BLOCK as u64)).unwrap().ns;
    let keys: Vec<Key> = (0..HELD).map(|j| key(i as u64 * 10_000 + j)).collect();
    let data: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| block(k.0.router_hash(), BLOCK))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, &keys, &refs).unwrap();
}

fn report(d: &Daemon) -> ClusterReport {
    d.client().cluster().expect("cluster op")
}

/// Polls `d`'s cluster report until `ok` holds; returns how long that took.
fn wait_for(
    d: &Daemon,
    what: &str,
    limit: Duration,
    ok: impl Fn(&ClusterReport) -> bool,
) -> Duration {
    let t = Instant::now();
    loop {
        let r = report(d);
        if ok(&r) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < limit,
            "{what}: not within {limit:?}; report: {r:#?}\nlog:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (up to 5 s: the agent logs between two attempts to reach etcd) for `what` in the log.
fn wait_log(d: &Daemon, what: &str) {
    let t = Instant::now();
    while !d.log().contains(what) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what:?} not logged:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `/metrics` of node `i`, scraped from inside its namespace.
fn scrape(cl: &Cluster, i: usize) -> String {
    let addr = format!("{}:9100", cl.fabric.node_ip(i));
    kvnode_e2e::fabric::http(cl.fabric.ns(i), &addr, "GET", "/metrics", "").expect("scrape")
}

fn members(r: &ClusterReport) -> Vec<(String, Vec<String>)> {
    r.members
        .iter()
        .map(|m| (m.node_id.clone(), m.endpoints.clone()))
        .collect()
}

/// A hinted get of `keys` on `dst` naming `src` as the source.
fn pull(dst: &Daemon, src: &str, keys: &[Key]) -> OpReport {
    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    let hint = format!(
        r#"{{"source_control_endpoint":"{src}","block_hashes":[{}]}}"#,
        hashes.join(",")
    );
    let mut c = dst.client();
    let ns = c.register(&spec("cluster", BLOCK as u64)).unwrap().ns;
    let (pages, op) = c.get_hinted(ns, keys, Some(&hint), Some(5_000)).unwrap();
    let op = op.expect("a hinted get reports its pull");
    if op.state == OpState::Done {
        for (k, p) in keys.iter().zip(&pages) {
            assert_eq!(
                p.as_deref(),
                Some(block(k.0.router_hash(), BLOCK).as_slice()),
                "pulled bytes differ"
            );
        }
    }
    op
}

fn assert_pulled(op: &OpReport, log: &str) {
    assert_eq!(op.state, OpState::Done, "{op:?}\nlog:\n{log}");
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::Pulled),
        "{op:?}"
    );
}

/// A hinted get on node `from` naming node `to`'s `port` (two fresh keys of node `to`):
/// refused with `why`, and a [`DialTrap`] on that endpoint saw no dial.
fn assert_refused_undialled(
    cl: &mut Cluster,
    n: &[Daemon],
    from: usize,
    to: usize,
    port: u16,
    why: &str,
) {
    let trap = DialTrap::arm(&cl.fabric, from, to, port);
    let keys = cl.fresh(to);
    assert_refused(&pull(&n[from - 1], &cl.endpoint(to, port), &keys), why);
    trap.assert_never_dialled(&format!("n{from} hinted at n{to}:{port} ({why})"));
}

/// Refused before any dial: `NotAuthorized`, with `why` in the reason.
fn assert_refused(op: &OpReport, why: &str) {
    assert_eq!(op.state, OpState::Failed, "{op:?}");
    let r = op.reason.as_ref().expect("a refused hint says why");
    assert_eq!(r.code, FailCode::NotAuthorized, "{op:?}");
    assert!(
        r.message.contains(why),
        "expected {why:?} in {:?}",
        r.message
    );
    assert!(op.peer.is_none(), "nothing may be dialled: {op:?}");
}

#[test]
fn members_pull_without_peers_and_crashes_restarts_and_partitions_show_in_the_membership() {
    if !runnable() {
        return;
    }
    let mut cl = Cluster::new("m", 81, 4);
    cl.etcd = Some(Etcd::start(&cl.fabric, &cl.dir));
    let mut n: Vec<Daemon> = (1..=3).map(|i| cl.start(i, 7700)).collect();
    for d in &n {
        wait_for(d, "three members", Duration::from_secs(15), |r| {
            r.members.len() == 3
        });
    }
    for (i, d) in n.iter().enumerate() {
        seed(d, i + 1);
    }
    let r = report(&n[0]);
    assert_eq!(
        members(&r),
        (1..=3)
            .map(|i| (format!("n{i}"), vec![cl.endpoint(i, 7700)]))
            .collect::<Vec<_>>()
    );
    assert!(
        r.members
            .iter()
            .all(|m| m.compatible && m.peer_protocol >= 1)
    );
    assert!(r.members[0].this_node && r.summary.registered && r.summary.in_force);
    assert!(r.members.iter().all(|m| {
        m.tiers
            .iter()
            .any(|t| t.tier == "dram" && t.capacity_bytes > 0)
    }));

    // Hinted pulls between members, no --peers anywhere.
    for (dst, src) in [(2, 1), (3, 2), (1, 3)] {
        let keys = cl.fresh(src);
        let op = pull(&n[dst - 1], &cl.endpoint(src, 7700), &keys);
        assert_pulled(&op, &n[src - 1].log());
    }
    // An endpoint no member advertises (a member's address, another port).
    assert_refused_undialled(&mut cl, &n, 2, 1, 7799, "not a live cluster member");

    crash_and_restart_at_a_new_port(&mut cl, &mut n);
    partition_and_heal(&mut cl, &n);
    clean_stop_revokes_the_record(&mut n);
    drop(n);
    let _ = std::fs::remove_dir_all(&cl.dir);
}

/// SIGKILL node 3, then bring it back at port 7701.
fn crash_and_restart_at_a_new_port(cl: &mut Cluster, n: &mut [Daemon]) {
    // SIGKILL node 3: it leaves the others' membership within its TTL (plus etcd's lease
    // check period), and hints naming it are refused before any dial.
    n[2].child.kill().unwrap();
    let t = Instant::now();
    for d in &n[..2] {
        wait_for(
            d,
            "n3 gone after SIGKILL",
            Duration::from_secs(TTL_S + 4),
            |r| r.members.len() == 2,
        );
    }
    let gone = t.elapsed();
    eprintln!("SIGKILLed member left the membership after {gone:?} (ttl {TTL_S} s)");
    assert!(gone <= Duration::from_secs(TTL_S + 2), "{gone:?}");
    assert_refused_undialled(cl, n, 1, 3, 7700, "not a live cluster member");

    // Node 3 back at a new port: accepted there, refused at the old one.
    n[2] = cl.start(3, 7701);
    seed(&n[2], 3);
    let new_ep = cl.endpoint(3, 7701);
    for d in &n[..2] {
        wait_for(d, "n3 back at 7701", Duration::from_secs(10), |r| {
            r.members
                .iter()
                .any(|m| m.node_id == "n3" && m.endpoints == [new_ep.clone()])
        });
    }
    assert_refused_undialled(cl, n, 1, 3, 7700, "not a live cluster member");
    let keys = cl.fresh(3);
    assert_pulled(&pull(&n[0], &new_ep, &keys), &n[2].log());
}

/// SIGTERM node 1: a clean stop revokes its etcd lease (the record goes at once, not after
/// its ttl), and the others drop it from the membership.
fn clean_stop_revokes_the_record(n: &mut [Daemon]) {
    n[0].signal(libc::SIGTERM);
    let status = n[0].wait_exit(Duration::from_secs(15));
    assert!(
        status.is_some_and(|s| s.success()),
        "clean stop: {status:?}\n{}",
        n[0].log()
    );
    assert!(
        n[0].log()
            .contains("cluster: lease revoked, left the membership"),
        "the stopping daemon did not revoke its lease:\n{}",
        n[0].log()
    );
    for d in &n[1..] {
        wait_for(
            d,
            "n1 gone after a clean stop",
            Duration::from_secs(10),
            |r| members(r).iter().all(|(id, _)| id != "n1"),
        );
    }
}

/// Cut node 2 off and reconnect it.
fn partition_and_heal(cl: &mut Cluster, n: &[Daemon]) {
    // Partition node 2 (its switch port down: no answers, no resets).
    cl.fabric.set_connected(2, false);
    let t = Instant::now();
    for i in [0, 2] {
        wait_for(
            &n[i],
            "partitioned n2 dropped",
            Duration::from_secs(TTL_S + 6),
            |r| {
                members(r).iter().all(|(id, _)| id != "n2")
                    && r.summary.state == ClusterState::Healthy
            },
        );
    }
    eprintln!(
        "partitioned member dropped by the others after {:?}",
        t.elapsed()
    );
    assert_refused_undialled(cl, n, 1, 2, 7700, "not a live cluster member");
    // Node 2 itself: etcd unreachable -> degraded (last view in force) -> expired.
    wait_for(&n[1], "n2 degraded", Duration::from_secs(5), |r| {
        r.summary.state == ClusterState::Degraded && !r.summary.etcd_healthy
    });
    let expired = wait_for(
        &n[1],
        "n2 expired",
        Duration::from_secs(cl.grace_s + 4),
        |r| r.summary.state == ClusterState::Expired && !r.summary.in_force,
    );
    eprintln!("partitioned node's own membership expired {expired:?} after it was seen degraded");
    assert_refused_undialled(cl, n, 2, 1, 7700, "past the membership grace");

    // Heal: node 2 registers again and everyone sees three members.
    cl.fabric.set_connected(2, true);
    for d in n {
        wait_for(
            d,
            "three members after the partition",
            Duration::from_secs(15),
            |r| {
                r.members.len() == 3
                    && r.summary.state == ClusterState::Healthy
                    && r.summary.registered
            },
        );
    }
    assert!(report(&n[1]).summary.reconnects >= 1);
    let keys = cl.fresh(2);
    assert_pulled(&pull(&n[0], &cl.endpoint(2, 7700), &keys), &n[1].log());
    let keys = cl.fresh(1);
    assert_pulled(&pull(&n[1], &cl.endpoint(1, 7700), &keys), &n[0].log());
}

#[test]
fn etcd_outage_keeps_known_members_for_the_grace_then_refuses_and_all_reregister() {
    if !runnable() {
        return;
    }
    let mut cl = Cluster::new("o", 82, 5);
    // Daemons start while etcd is down, say so, and refuse member hints meanwhile.
    let n: Vec<Daemon> = (1..=3).map(|i| cl.start(i, 7700)).collect();
    for d in &n {
        let r = report(d);
        assert_eq!(r.summary.state, ClusterState::Connecting, "{r:?}");
        assert!(!r.summary.in_force);
    }
    assert_refused_undialled(&mut cl, &n, 1, 2, 7700, "etcd has not answered");
    wait_log(&n[0], "cannot reach etcd");

    let mut etcd = Etcd::start(&cl.fabric, &cl.dir);
    for d in &n {
        wait_for(
            d,
            "registered once etcd is up",
            Duration::from_secs(15),
            |r| r.members.len() == 3 && r.summary.registered,
        );
    }
    for (i, d) in n.iter().enumerate() {
        seed(d, i + 1);
    }
    let keys = cl.fresh(2);
    assert_pulled(&pull(&n[0], &cl.endpoint(2, 7700), &keys), &n[1].log());
    let m = scrape(&cl, 1);
    for want in [
        "kvnode_cluster_members 3",
        "kvnode_cluster_etcd_healthy 1",
        "kvnode_cluster_registered 1",
        "kvnode_cluster_membership_in_force 1",
        "kvnode_cluster_membership_age_seconds ",
    ] {
        assert!(
            m.lines().any(|l| l.starts_with(want)),
            "no {want:?} in:\n{m}"
        );
    }

    incompatible_member_is_listed_and_refused(&mut cl, &etcd, &n);
    outage_grace_expiry(&mut cl, &mut etcd, &n);
    // etcd back with its data wiped: every daemon registers again.
    etcd.restart(true);
    for d in &n {
        wait_for(
            d,
            "re-registered after etcd came back",
            Duration::from_secs(15),
            |r| {
                r.members.len() == 3
                    && r.summary.registered
                    && r.summary.state == ClusterState::Healthy
            },
        );
        assert!(report(d).summary.reconnects >= 1);
    }
    let keys = cl.fresh(2);
    assert_pulled(&pull(&n[0], &cl.endpoint(2, 7700), &keys), &n[1].log());
    let keys = cl.fresh(1);
    assert_pulled(&pull(&n[2], &cl.endpoint(1, 7700), &keys), &n[0].log());
    let out = Command::new(kvnode_bin())
        .args(["cluster", "members", "--socket"])
        .arg(n[2].socket())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("3 live members") && text.contains("this node"),
        "{text}"
    );
    drop(n);
    drop(etcd);
    let _ = std::fs::remove_dir_all(&cl.dir);
}

/// A record from a newer release, written straight into etcd.
fn incompatible_member_is_listed_and_refused(cl: &mut Cluster, etcd: &Etcd, n: &[Daemon]) {
    // A member from a newer release (the next peer protocol): listed, refused with the reason.
    let next = kvnode_proto::peer::PEER_PROTOCOL_VERSION + 1;
    let future = format!("tcp://{}:7702", cl.fabric.node_ip(3));
    let rec = format!(
        r#"{{"record":1,"node_id":"future","instance":"x","endpoints":["{future}"],"transports":["tcp"],"version":"9.0.0","peer_protocol":{next}}}"#
    );
    etcd.put("/kvnode/clusters/e2e-o/members/future", &rec)
        .unwrap();
    wait_for(
        &n[0],
        "the future member listed",
        Duration::from_secs(5),
        |r| {
            r.summary.incompatible_members == 1
                && r.members
                    .iter()
                    .any(|m| m.node_id == "future" && !m.compatible)
        },
    );
    let why = format!("peer protocol v{next}");
    assert_refused_undialled(cl, n, 1, 3, 7702, &why);
}

/// etcd killed: degraded within the grace, expired after it.
fn outage_grace_expiry(cl: &mut Cluster, etcd: &mut Etcd, n: &[Daemon]) {
    // etcd dies: members stay usable for the grace...
    etcd.kill();
    let down = Instant::now();
    wait_for(
        &n[0],
        "degraded after etcd died",
        Duration::from_secs(4),
        |r| r.summary.state == ClusterState::Degraded && r.summary.in_force,
    );
    let keys = cl.fresh(2);
    let op = pull(&n[0], &cl.endpoint(2, 7700), &keys);
    assert!(
        down.elapsed() < Duration::from_secs(cl.grace_s),
        "too slow to test the grace"
    );
    assert_pulled(&op, &n[1].log());
    // ... then hints to members are refused, and stats and the CLI say why.
    wait_for(
        &n[0],
        "expired after the grace",
        Duration::from_secs(cl.grace_s + 3),
        |r| r.summary.state == ClusterState::Expired,
    );
    assert_refused_undialled(cl, n, 1, 2, 7700, "past the membership grace");
    let s = n[0]
        .client()
        .stats()
        .unwrap()
        .cluster
        .expect("stats carry the cluster");
    assert!(
        !s.in_force && !s.etcd_healthy && s.refused_hints >= 1,
        "{s:?}"
    );
    let m = scrape(cl, 1);
    for want in [
        "kvnode_cluster_etcd_healthy 0",
        "kvnode_cluster_membership_in_force 0",
        "kvnode_cluster_registered 0",
    ] {
        assert!(m.lines().any(|l| l == want), "no {want:?} in:\n{m}");
    }
    let out = Command::new(kvnode_bin())
        .args(["cluster", "status", "--socket"])
        .arg(n[0].socket())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("expired"), "{text}");
    wait_log(&n[0], "past the grace");
}

/// Settings that cannot work stop `serve` at once with the reason; `[cluster]` in the config
/// file is read (and shown by `--print-config`). Needs neither root nor etcd.
#[test]
fn cluster_settings_that_cannot_work_are_refused_at_start() {
    let dir = temp_dir("cluster-cfg");
    let key = dir.join("k");
    std::fs::write(&key, "cluster-test-key-0123456789abcdef").unwrap();
    let key = key.to_str().unwrap();
    let url = "etcd://127.0.0.1:2379/cfg";
    for (args, why) in [
        (vec!["--cluster", url], "needs --cluster-key"),
        (
            vec!["--cluster", url, "--cluster-key", key],
            "needs a peer endpoint",
        ),
        (
            vec![
                "--cluster",
                "http://127.0.0.1:2379/cfg",
                "--cluster-key",
                key,
            ],
            "must start with etcd://",
        ),
        (
            vec![
                "--cluster",
                url,
                "--cluster-key",
                key,
                "--peer-listen",
                "127.0.0.1:7790",
                "--cluster-ttl",
                "1",
            ],
            "ttl_s must be 2..=3600",
        ),
    ] {
        let (status, log) = Daemon::start_failing(&args, Duration::from_secs(10));
        assert!(
            !status.success() && log.contains(why),
            "{args:?}: expected {why:?} in:\n{log}"
        );
    }
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        format!(
            "[peer]\nlisten = \"127.0.0.1:7791\"\ncluster_key = \"{key}\"\n\n[cluster]\netcd = \"etcds://127.0.0.1:2379/cfg\"\nca_file = \"{}/missing-ca.pem\"\nttl_s = 5\n",
            dir.display()
        ),
    )
    .unwrap();
    let out = kvnode_e2e::kvnode_cmd()
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("[cluster]") && text.contains("ttl_s = 5"),
        "{text}"
    );
    let (status, log) = Daemon::start_failing(
        &["--config", cfg.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert!(!status.success() && log.contains("missing-ca.pem"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
