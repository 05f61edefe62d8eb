//! Attacks through etcd on the cluster membership (issue 25 item 9). Pins: a writer that
//! overwrites this daemon's member record (another endpoint, another instance) is undone:
//! the agent registers again at once and peers never follow the forged endpoint; with
//! CIDRs in `--peers`, a member record naming an address outside them is refused before any
//! dial. Real etcd and a real daemon in a network namespace (`kvnode_e2e::fabric`); needs
//! root, iproute2 and Debian's `etcd-server` (fails without them unless
//! `KVNODE_TEST_ALLOW_SKIP=root,ip,etcd`).
//! Run: `cargo test --release -p kvnode-e2e --test attack_cluster`.

use std::time::{Duration, Instant};

use kvnode_e2e::dialtrap::DialTrap;
use kvnode_e2e::fabric::{Etcd, Fabric};
use kvnode_e2e::{Daemon, key, spec, temp_dir};
use kvnode_proto::cluster::ClusterReport;
use kvnode_proto::pull::{FailCode, OpState};

fn report(d: &Daemon) -> ClusterReport {
    d.client().cluster().expect("cluster op")
}

fn wait_for(d: &Daemon, what: &str, ok: impl Fn(&ClusterReport) -> bool) {
    let t = Instant::now();
    loop {
        let r = report(d);
        if ok(&r) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{what}: {r:#?}\nlog:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_forged_own_record_is_undone_and_members_outside_the_cidrs_are_refused() {
    if !kvnode_e2e::netns_prerequisites(&[(
        "etcd",
        "--version",
        "Debian: etcd-server; scripts/install-deps.sh",
    )]) {
        return;
    }
    let fabric = Fabric::create("ac", 97, 2).expect("building the test network");
    let dir = temp_dir("attack-cluster");
    let key_file = dir.join("cluster.key");
    std::fs::write(&key_file, "cluster-test-key-0123456789abcdef\n").unwrap();
    let etcd = Etcd::start(&fabric, &dir);
    let url = format!("etcd://{}:2379/e2e-ac", fabric.etcd_ip());
    let listen = format!("{}:7700", fabric.node_ip(1));
    let own = format!("tcp://{listen}");
    let d = Daemon::start_in_netns(
        fabric.ns(1),
        &[
            "--dram",
            "48MiB",
            "--no-pin",
            "--peer-listen",
            &listen,
            "--cluster-key",
            key_file.to_str().unwrap(),
            "--cluster",
            &url,
            "--node-id",
            "n1",
            "--cluster-ttl",
            "2",
            "--peers",
            "10.250.0.0/16",
        ],
    );
    wait_for(&d, "registered", |r| {
        r.summary.registered && r.members.iter().any(|m| m.node_id == "n1")
    });

    // Someone with write access to etcd points n1 at an address of theirs.
    let forged = format!("tcp://{}:7799", fabric.node_ip(2));
    let rec = format!(
        r#"{{"record":1,"node_id":"n1","instance":"forged","endpoints":["{forged}"],"transports":["tcp"],"version":"9.0.0","peer_protocol":{}}}"#,
        kvnode_proto::peer::PEER_PROTOCOL_VERSION
    );
    etcd.put("/kvnode/clusters/e2e-ac/members/n1", &rec)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    wait_for(&d, "own record restored", |r| {
        r.summary.registered
            && r.members
                .iter()
                .any(|m| m.node_id == "n1" && m.endpoints == vec![own.clone()])
    });
    assert!(d.log().contains("record was overwritten"), "{}", d.log());

    // A member record outside --peers' CIDR: refused before any dial.
    let rogue = format!("tcp://{}:7702", fabric.node_ip(2));
    let rec = format!(
        r#"{{"record":1,"node_id":"rogue","instance":"x","endpoints":["{rogue}"],"transports":["tcp"],"version":"0.0.0","peer_protocol":{}}}"#,
        kvnode_proto::peer::PEER_PROTOCOL_VERSION
    );
    etcd.put("/kvnode/clusters/e2e-ac/members/rogue", &rec)
        .unwrap();
    wait_for(&d, "rogue listed", |r| {
        r.members.iter().any(|m| m.node_id == "rogue")
    });
    let keys = vec![key(1), key(2)];
    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    let hint = format!(
        r#"{{"source_control_endpoint":"{rogue}","block_hashes":[{}]}}"#,
        hashes.join(",")
    );
    // Watched from outside the daemon: a listener at the rogue endpoint, and a count of SYNs
    // n1 sends there.
    let trap = DialTrap::arm(&fabric, 1, 2, 7702);
    let mut c = d.client();
    let ns = c.register(&spec("cluster", 4096)).unwrap().ns;
    let (_, op) = c.get_hinted(ns, &keys, Some(&hint), Some(2000)).unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Failed, "{op:?}");
    let why = op.reason.unwrap();
    assert_eq!(why.code, FailCode::NotAuthorized);
    assert!(why.message.contains("outside every CIDR"), "{why:?}");
    assert!(op.peer.is_none(), "nothing may be dialled");
    trap.assert_never_dialled("a hint naming a member outside --peers' CIDRs");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}
