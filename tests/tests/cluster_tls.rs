//! Cluster membership over TLS with etcd's own authentication: etcd serves `https://` only,
//! demands a client certificate signed by the test CA, and has auth enabled with a `kvnode`
//! user whose role may read and write only `/kvnode/clusters/e2e-t/`. Two daemons configured
//! through `[cluster]` (etcds://, CA, client certificate, user, password file) register, see
//! each other and pull; a third with a wrong password stays unregistered and says why.
//! Needs root, iproute2, `etcd` and `openssl` (certificates are made here): without them it
//! fails, unless `KVNODE_TEST_ALLOW_SKIP=root,ip,etcd` says skipping is intended.
//! Run: `cargo build --release -p kvnode && cargo test --release -p kvnode-e2e --test cluster_tls`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::fabric::{Etcd, Fabric, base64};
use kvnode_e2e::{Daemon, block, key, spec, temp_dir};
use kvnode_proto::Key;
use kvnode_proto::cluster::ClusterReport;
use kvnode_proto::pull::{KeyOutcome, OpState};

const BLOCK: usize = 64 << 10;
const PREFIX: &str = "/kvnode/clusters/e2e-t/";

fn runnable() -> bool {
    kvnode_e2e::netns_prerequisites(&[
        (
            "etcd",
            "--version",
            "Debian: etcd-server; scripts/install-deps.sh",
        ),
        ("openssl", "version", "Debian: openssl"),
    ])
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for `ip`, and a client certificate (P-256 keys).
fn certificates(dir: &Path, ip: &str) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "2", "-subj", "/CN=kvnode-test-ca"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    for (name, ext) in [
        (
            "server",
            format!("subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth\n"),
        ),
        ("client", "extendedKeyUsage=clientAuth\n".to_owned()),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        let subj = format!("/CN=kvnode-{name}");
        let (k, csr) = (format!("{name}.key"), format!("{name}.csr"));
        let mut req = vec!["req", "-subj", subj.as_str()];
        req.extend(ec);
        req.extend(["-keyout", k.as_str(), "-out", csr.as_str()]);
        openssl(dir, &req);
        let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-days",
                "2",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
        );
    }
}

/// Users `root` and `kvnode` (readwrite on PREFIX only), then auth on; over plain HTTP.
fn enable_auth(etcd: &Etcd) {
    let b = |s: &str| base64(s.as_bytes());
    let end = "/kvnode/clusters/e2e-t0"; // PREFIX with its last byte + 1: the range end
    for (path, body) in [
        ("/v3/auth/role/add", r#"{"name":"root"}"#.to_owned()),
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"root-pw"}"#.to_owned(),
        ),
        (
            "/v3/auth/user/grant",
            r#"{"user":"root","role":"root"}"#.to_owned(),
        ),
        ("/v3/auth/role/add", r#"{"name":"kvnode"}"#.to_owned()),
        (
            "/v3/auth/role/grant",
            format!(
                r#"{{"name":"kvnode","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                b(PREFIX),
                b(end)
            ),
        ),
        (
            "/v3/auth/user/add",
            r#"{"name":"kvnode","password":"kvnode-pw"}"#.to_owned(),
        ),
        (
            "/v3/auth/user/grant",
            r#"{"user":"kvnode","role":"kvnode"}"#.to_owned(),
        ),
        ("/v3/auth/enable", "{}".to_owned()),
    ] {
        etcd.call(path, &body);
    }
}

fn start(f: &Fabric, dir: &Path, i: usize, password: &str) -> Daemon {
    let pw = dir.join(format!("pw{i}"));
    std::fs::write(&pw, format!("{password}\n")).unwrap();
    let cfg = dir.join(format!("n{i}.toml"));
    let d = dir.display();
    std::fs::write(
        &cfg,
        format!(
            r#"
[peer]
listen = "{ip}:7700"
cluster_key = "{d}/cluster.key"

[cluster]
etcd = "etcds://{etcd}:2379/e2e-t"
node_id = "n{i}"
ttl_s = 2
grace_s = 4
user = "kvnode"
password_file = "{pw}"
ca_file = "{d}/ca.pem"
cert_file = "{d}/client.pem"
key_file = "{d}/client.key"
"#,
            ip = f.node_ip(i),
            etcd = f.etcd_ip(),
            pw = pw.display(),
        ),
    )
    .unwrap();
    Daemon::start_in_netns(
        f.ns(i),
        &[
            "--dram",
            "32MiB",
            "--no-pin",
            "--config",
            cfg.to_str().unwrap(),
        ],
    )
}

fn wait_for(d: &Daemon, what: &str, ok: impl Fn(&ClusterReport) -> bool) -> ClusterReport {
    let t = Instant::now();
    loop {
        let r = d.client().cluster().unwrap();
        if ok(&r) {
            return r;
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
fn members_register_over_tls_with_client_certificates_and_an_etcd_password() {
    if !runnable() {
        return;
    }
    let f = Fabric::create("t", 83, 3).expect("building the test network");
    let dir = temp_dir("cluster-tls");
    std::fs::write(
        dir.join("cluster.key"),
        "cluster-tls-key-0123456789abcdef\n",
    )
    .unwrap();
    certificates(&dir, &f.etcd_ip());
    let mut etcd = Etcd::start(&f, &dir);
    enable_auth(&etcd);
    let p = |n: &str| dir.join(n).display().to_string();
    let url = format!("https://{}:2379", f.etcd_ip());
    etcd.restart_with(
        false,
        &[
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url,
            "--cert-file".into(),
            p("server.pem"),
            "--key-file".into(),
            p("server.key"),
            "--trusted-ca-file".into(),
            p("ca.pem"),
            "--client-cert-auth".into(),
        ],
    );
    let n: Vec<Daemon> = (1..=2).map(|i| start(&f, &dir, i, "kvnode-pw")).collect();
    for d in &n {
        wait_for(d, "two members over TLS", |r| {
            r.members.len() == 2 && r.summary.registered
        });
    }
    // A hinted pull between them (membership authorizes it; the cluster key authenticates).
    let keys: Vec<Key> = (0..2).map(key).collect();
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, BLOCK)).collect();
    let mut c = n[0].client();
    let ns = c.register(&spec("tls", BLOCK as u64)).unwrap().ns;
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.put(ns, &keys, &refs).unwrap();
    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    let hint = format!(
        r#"{{"source_control_endpoint":"tcp://{}:7700","block_hashes":[{}]}}"#,
        f.node_ip(1),
        hashes.join(",")
    );
    let mut c2 = n[1].client();
    let ns2 = c2.register(&spec("tls", BLOCK as u64)).unwrap().ns;
    let (pages, op) = c2.get_hinted(ns2, &keys, Some(&hint), Some(5_000)).unwrap();
    let op = op.unwrap();
    assert_eq!(op.state, OpState::Done, "{op:?}");
    assert!(op.results.iter().all(|r| *r == KeyOutcome::Pulled));
    assert_eq!(pages[1].as_deref(), Some(data[1].as_slice()));

    // A wrong password: the daemon runs, stays unregistered, and says why.
    let bad = start(&f, &dir, 3, "not-the-password");
    let r = wait_for(&bad, "authentication failure reported", |r| {
        r.summary.last_error.is_some()
    });
    assert!(!r.summary.registered && r.members.is_empty(), "{r:#?}");
    let e = r.summary.last_error.unwrap();
    assert!(e.contains("authentication failed"), "{e}");
    assert_eq!(n[0].client().cluster().unwrap().members.len(), 2);
    drop((n, bad, etcd));
    let _ = std::fs::remove_dir_all(&dir);
}
