//! A pull between two daemons in two network namespaces joined only by a veth pair: the
//! bytes cross that link (its counters move), with cluster-key authentication. Needs root
//! and `ip` (iproute2): without them it fails, unless `KVNODE_TEST_ALLOW_SKIP=root,ip` says
//! skipping is intended. Run: `sudo cargo test --release -p kvnode-e2e --test peer_netns`.

use kvnode_e2e::netns::{Namespaces, SRC_IP};
use kvnode_e2e::{block, key, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::pull::{KeyOutcome, OpState};

const BLOCK: usize = 256 << 10;
const PORT: u16 = 7700;

/// Whether this test can run: root, and iproute2 installed (else see `prerequisite`).
fn runnable() -> bool {
    kvnode_e2e::netns_prerequisites(&[])
}

#[test]
fn pull_between_two_network_namespaces_crosses_only_their_veth_link() {
    if !runnable() {
        return;
    }
    let ns = Namespaces::create().expect("setting up two network namespaces and a veth pair");
    let dir = temp_dir("netns-key");
    let key_file = dir.join("cluster.key");
    std::fs::write(&key_file, "netns-test-cluster-key-0123456789\n").unwrap();
    let endpoint = format!("tcp://{SRC_IP}:{PORT}");
    let (src, dst) = ns.keyed_pair(PORT, &key_file, "64MiB", &[]);
    let keys: Vec<Key> = (0..8).map(key).collect();
    let mut sc = src.client();
    let sns = sc.register(&spec("netns", BLOCK as u64)).unwrap().ns;
    let data: Vec<Vec<u8>> = (0..8).map(|i| block(i, BLOCK)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    sc.put(sns, &keys, &refs).unwrap();

    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    let hint = format!(
        r#"{{"source_control_endpoint":"{endpoint}","block_hashes":[{}]}}"#,
        hashes.join(",")
    );
    let rx0 = ns.rx_bytes_b();
    let mut c = dst.client();
    let dns = c.register(&spec("netns", BLOCK as u64)).unwrap().ns;
    let (pages, op) = c.get_hinted(dns, &keys, Some(&hint), Some(10_000)).unwrap();
    let op = op.unwrap();
    assert_eq!(
        op.state,
        OpState::Done,
        "{op:?}\nsource log:\n{}",
        src.log()
    );
    assert!(
        op.results.iter().all(|r| *r == KeyOutcome::Pulled),
        "{op:?}"
    );
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(p.as_deref(), Some(data[i].as_slice()), "page {i} differs");
    }
    let crossed = ns.rx_bytes_b() - rx0;
    assert!(
        crossed >= (8 * BLOCK) as u64,
        "only {crossed} bytes crossed the veth link for {} pulled",
        8 * BLOCK
    );
    drop((src, dst));
    let _ = std::fs::remove_dir_all(&dir);
}
