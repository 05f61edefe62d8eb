//! Scale check of the membership agent without daemons: registers N synthetic members (one
//! lease and one record each, like N daemons) in a running etcd, then starts a real agent
//! and measures
//! - watch start-up: agent start until its view holds all N + 1 members (connect, lease,
//!   register, list, watch);
//! - update latency: a member joining (lease + put) or leaving (lease revoked) until the
//!   agent's view authorizes or refuses its endpoint; p50 / p99 / max over 50 of each;
//! - memory: the process's RSS before any agent, with an agent on an empty cluster, and with
//!   an agent holding the N members.
//!
//! Run (etcd on loopback, data in a tmpfs or a scratch dir):
//! `etcd --data-dir /tmp/scale-etcd --listen-client-urls http://127.0.0.1:23790
//!  --advertise-client-urls http://127.0.0.1:23790 --listen-peer-urls http://127.0.0.1:23800 &`
//! `cargo run --release -p kvnode-cluster --example scale -- 127.0.0.1:23790 1000`

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, PutOptions};
use kvnode_cluster::{ClusterConfig, MemberRecord, Registration, View};
use kvnode_proto::cluster::MemberTier;
use tokio::sync::watch;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn record(i: usize) -> MemberRecord {
    MemberRecord {
        record: 1,
        node_id: format!("synthetic-{i:05}"),
        instance: format!("{i:016x}"),
        endpoints: vec![endpoint(i)],
        transports: vec!["tcp".into()],
        version: "0.1.0".into(),
        peer_protocol: kvnode_proto::peer::PEER_PROTOCOL_VERSION,
        tiers: vec![
            MemberTier {
                tier: "dram".into(),
                capacity_bytes: 512 << 30,
            },
            MemberTier {
                tier: "nvme".into(),
                capacity_bytes: 8 << 40,
            },
        ],
        key_id: Some("0123456789abcdef".into()),
        registered_unix_ms: 1,
    }
}

fn endpoint(i: usize) -> String {
    format!(
        "tcp://10.{}.{}.{}:7700",
        i >> 16 & 255,
        i >> 8 & 255,
        i & 255
    )
}

/// Registers member `i` under its own lease; returns the lease.
async fn register(c: &mut Client, prefix: &str, i: usize) -> i64 {
    let lease = c.lease_grant(300, None).await.expect("lease grant").id();
    let r = record(i);
    c.put(
        format!("{prefix}{}", r.node_id),
        r.to_json(),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("put");
    lease
}

/// Spins until `ok` holds for the view; returns the time it took.
fn until(view: &View, ok: impl Fn(&View) -> bool) -> Duration {
    let t = Instant::now();
    while !ok(view) {
        assert!(t.elapsed() < Duration::from_mins(1), "view did not follow");
        std::thread::sleep(Duration::from_micros(20));
    }
    t.elapsed()
}

fn pct(v: &mut [Duration]) -> String {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
    format!(
        "p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

fn agent_cfg(etcd: &str, name: &str) -> ClusterConfig {
    ClusterConfig {
        etcd: format!("etcd://{etcd}/{name}"),
        node_id: Some("scale-agent".into()),
        ttl_s: 10,
        ..ClusterConfig::default()
    }
}

fn registration() -> Registration {
    Registration {
        endpoints: vec!["tcp://127.0.0.1:1".into()],
        transports: vec!["tcp".into()],
        version: "0.1.0".into(),
        peer_protocol: kvnode_proto::peer::PEER_PROTOCOL_VERSION,
        tiers: Vec::new(),
        key_id: Some("0123456789abcdef".into()),
    }
}

/// The membership listed the way the agent lists it (pages of 1000 at one revision), alone.
async fn list_alone(c: &mut Client, prefix: &str) -> usize {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let (mut from, mut revision, mut n) = (prefix.as_bytes().to_vec(), 0, 0);
    loop {
        let mut o = etcd_client::GetOptions::new()
            .with_range(end.clone())
            .with_limit(1000);
        if revision > 0 {
            o = o.with_revision(revision);
        }
        let r = c.get(from.clone(), Some(o)).await.expect("list");
        revision = r.header().map_or(0, etcd_client::ResponseHeader::revision);
        n += r.kvs().len();
        match (r.more(), r.kvs().last()) {
            (true, Some(last)) => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return n,
        }
    }
}

/// Joins and leaves seen by the agent, next to the same etcd writes alone (the floor).
async fn updates(c: &mut Client, prefix: &str, view: &Arc<View>, n: usize) {
    let (mut join, mut leave) = (Vec::new(), Vec::new());
    for k in 0..50 {
        let i = n + 1 + k;
        let (host, port) = kvnode_cluster::record::endpoint_host_port(&endpoint(i)).unwrap();
        let t = Instant::now();
        let lease = register(c, prefix, i).await;
        let (v, h) = (Arc::clone(view), host.clone());
        let _ = tokio::task::spawn_blocking(move || until(&v, |v| v.check(&h, port).authorizes()))
            .await
            .unwrap();
        join.push(t.elapsed());
        let t = Instant::now();
        c.lease_revoke(lease).await.expect("revoke");
        let v = Arc::clone(view);
        let _ =
            tokio::task::spawn_blocking(move || until(&v, |v| !v.check(&host, port).authorizes()))
                .await
                .unwrap();
        leave.push(t.elapsed());
    }
    // The floor, same run: the etcd writes alone (durable, fsynced), with no watch in between.
    let (mut put_floor, mut revoke_floor) = (Vec::new(), Vec::new());
    for k in 0..50 {
        let t = Instant::now();
        let lease = register(c, prefix, n + 100 + k).await;
        put_floor.push(t.elapsed());
        let t = Instant::now();
        c.lease_revoke(lease).await.expect("revoke");
        revoke_floor.push(t.elapsed());
    }
    println!(
        "member join seen (lease grant + put -> view authorizes): {}",
        pct(&mut join)
    );
    println!(
        "  floor: lease grant + put alone, same run:              {}",
        pct(&mut put_floor)
    );
    println!(
        "member leave seen (lease revoke -> view refuses):         {}",
        pct(&mut leave)
    );
    println!(
        "  floor: lease revoke alone, same run:                   {}",
        pct(&mut revoke_floor)
    );
    let p50 = |v: &[Duration]| v[v.len() / 2].as_secs_f64();
    println!(
        "p50 / floor p50: join {:.2}x, leave {:.2}x (the excess over 1 is the watch's delivery)",
        p50(&join) / p50(&put_floor),
        p50(&leave) / p50(&revoke_floor)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let etcd = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:2379".into());
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let name = format!("scale-{}", std::process::id());
    let prefix = kvnode_cluster::config::members_prefix(&name);
    let client = Client::connect([format!("http://{etcd}")], None)
        .await
        .expect("connect to etcd");

    let t = Instant::now();
    let mut tasks = Vec::new();
    let per = n.div_ceil(16);
    for w in 0..16 {
        let mut c = client.clone();
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let mut leases = Vec::new();
            for i in (w * per)..((w + 1) * per).min(n) {
                leases.push(register(&mut c, &prefix, i).await);
            }
            leases
        }));
    }
    let mut leases = Vec::new();
    for t in tasks {
        leases.extend(t.await.expect("register task"));
    }
    println!(
        "registered {n} synthetic members (lease + put each, 16 in flight) in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let rss0 = rss_kib();

    let (stop_tx, stop) = watch::channel(false);
    let empty = kvnode_cluster::start(
        &agent_cfg(&etcd, &format!("{name}-empty")),
        registration(),
        stop.clone(),
    )
    .expect("agent on an empty cluster");
    until(&empty.view, |v| v.len() == 1);
    let rss1 = rss_kib();

    let t = Instant::now();
    let agent = kvnode_cluster::start(&agent_cfg(&etcd, &name), registration(), stop.clone())
        .expect("agent");
    let view = Arc::clone(&agent.view);
    let view2 = Arc::clone(&view);
    let _ = tokio::task::spawn_blocking(move || until(&view2, |v| v.len() == n + 1))
        .await
        .unwrap();
    let startup = t.elapsed();
    let rss2 = rss_kib();
    println!(
        "watch start-up: agent start -> view of {} members in {:.1} ms (connect, lease, register, list, watch)",
        n + 1,
        startup.as_secs_f64() * 1e3
    );

    let mut c = client.clone();
    let t = Instant::now();
    let listed = list_alone(&mut c, &prefix).await;
    println!(
        "  floor: the same paged listing of {listed} records alone, same run: {:.1} ms ({:.2}x)",
        t.elapsed().as_secs_f64() * 1e3,
        startup.as_secs_f64() / t.elapsed().as_secs_f64()
    );
    updates(&mut c, &prefix, &view, n).await;
    println!(
        "RSS: {rss0} KiB before any agent, {rss1} KiB with an agent on an empty cluster, {rss2} KiB with an agent holding {} members: {:.2} KiB per member",
        n + 1,
        rss2.saturating_sub(rss1) as f64 / n as f64
    );
    let record_bytes = record(0).to_json().len();
    println!("one member record: {record_bytes} bytes of JSON in etcd");

    let _ = stop_tx.send(true);
    let _ = agent.task.await;
    let _ = empty.task.await;
    for l in leases {
        let _ = c.lease_revoke(l).await;
    }
}
