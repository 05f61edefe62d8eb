//! Tenants with real uids: clients run as uid 64001 (tenant `a`) and 64002 (tenant `b`)
//! through the `tenant_probe` binary, against real daemons with a `[tenants]` map. Pins: B
//! cannot read (exists / inline get / lease) A's prefixes even naming A's salt or A's handle
//! (the cache_salt prompt-stealing attack, CVE-2025-46570), A can; quotas hold per tenant with
//! usage in `kvnode stats` and `/metrics`; a uid outside `allow_uids` is refused at accept with
//! a logged reason and a counted metric; a peer pull of A's blocks hits for A's client on
//! another daemon and misses for B's; KV events carry the daemon-derived salt, which Dynamo's
//! router hashes to the published block hashes.
//! Run (as root): `cargo test --release -p kvnode-e2e --test tenants`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::{
    Daemon, free_port, hint, key, not_root, prerequisite, spill_dir, stats_text, temp_dir,
};
use kvnode_proto::Key;

const UID_A: u32 = 64001;
const UID_B: u32 = 64002;
const LEN: u64 = 64 << 10;

/// Runs the probe as `uid` (gid = uid) and returns its `key value` lines.
fn probe(uid: u32, socket: &Path, args: &[&str]) -> HashMap<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_tenant_probe"))
        .arg(socket)
        .args(args)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("run tenant_probe");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "probe {args:?} as {uid} failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn can_switch_uids() -> bool {
    prerequisite(
        "root",
        not_root("the tests run clients as uids 64001 and 64002"),
    )
}

/// A daemon with the map `a` = uid 64001, `b` = uid 64002 (root: the default tenant), a
/// socket every uid may open, and `extra` config lines.
fn daemon(extra_top: &str, tenant_a: &str, extra_args: &[&str]) -> Daemon {
    let dir = temp_dir("tenants-cfg");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        format!(
            "socket_mode = 0o666\n{extra_top}\n\
             [[tenants.tenant]]\nname = \"a\"\nuids = [{UID_A}]\n{tenant_a}\n\
             [[tenants.tenant]]\nname = \"b\"\nuids = [{UID_B}]\n"
        ),
    )
    .unwrap();
    let mut args = vec!["--no-pin", "--config", cfg.to_str().unwrap()];
    if !extra_args.contains(&"--dram") {
        args.extend(["--dram", "64MiB"]);
    }
    args.extend_from_slice(extra_args);
    Daemon::start(&args)
}

fn get<'a>(m: &'a HashMap<String, String>, k: &str) -> &'a str {
    m.get(k)
        .map_or_else(|| panic!("no {k} in {m:?}"), String::as_str)
}

#[test]
fn another_tenant_cannot_read_a_prefix_even_naming_its_salt_or_handle() {
    if !can_switch_uids() {
        return;
    }
    let d = daemon("", "", &[]);
    let s = d.socket.clone();
    // A stores a prefix under its own (narrowing) salt "shared-prompt" and under none.
    for salt in ["shared-prompt", "-"] {
        let put = probe(UID_A, &s, &["put", salt, "4", &LEN.to_string()]);
        assert_eq!(get(&put, "stored"), "4", "{put:?}");
    }
    let a = probe(UID_A, &s, &["read", "shared-prompt", "4", &LEN.to_string()]);
    assert_eq!(get(&a, "exists"), "4", "{a:?}");
    assert_eq!(get(&a, "inline_same"), "4", "{a:?}");
    // Tenants get no arena mapping by default: a lease only pins (nothing to read it with).
    assert_eq!(get(&a, "arena_bytes"), "0");
    assert_eq!(get(&a, "lease_hits"), "4", "{a:?}");
    let a_ns = get(&a, "ns").to_owned();

    // The attack: B names A's salt (and A's derived salt, and nothing): every read misses.
    for salt in [
        "shared-prompt",
        "-",
        "kvnode-tenant:a",
        "kvnode-tenant:a/shared-prompt",
    ] {
        let b = probe(UID_B, &s, &["read", salt, "4", &LEN.to_string()]);
        assert_eq!(get(&b, "exists"), "0", "salt {salt}: {b:?}");
        assert_eq!(get(&b, "inline_hits"), "0", "salt {salt}: {b:?}");
        assert_eq!(get(&b, "lease_hits"), "0", "salt {salt}: {b:?}");
        assert_ne!(get(&b, "id"), get(&a, "id"), "salt {salt}");
        assert_ne!(get(&b, "ns"), a_ns, "salt {salt}");
    }
    // B uses A's handle directly: it answers exactly like a handle that does not exist, and
    // B can neither delete, overwrite nor clear A's blocks.
    let b = probe(UID_B, &s, &["handle", &a_ns, "4"]);
    for op in [
        "exists_error",
        "inline_error",
        "lease_error",
        "delete_error",
        "put_error",
        "act_error",
    ] {
        assert!(
            get(&b, op).contains(&format!("unknown namespace handle {a_ns}")),
            "{op}: {b:?}"
        );
    }
    assert_eq!(
        get(&b, "cleared"),
        "0",
        "B's clear --all clears only B's: {b:?}"
    );
    let a = probe(UID_A, &s, &["read", "shared-prompt", "4", &LEN.to_string()]);
    assert_eq!(get(&a, "inline_same"), "4", "A's blocks survive B: {a:?}");

    // B's stats show B's row only; root sees both.
    let bs = probe(UID_B, &s, &["stats"]);
    assert_eq!(get(&bs, "tenants"), "b", "{bs:?}");
    let text = stats_text(&s);
    assert!(text.contains("\na ") && text.contains("\nb "), "{text}");
}

#[test]
fn quotas_hold_per_tenant_with_usage_in_stats_and_metrics() {
    if !can_switch_uids() {
        return;
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // A may hold 1 MiB of DRAM (16 blocks of 64 KiB); B has no quota.
    let d = daemon("", "dram_quota = \"1MiB\"", &["--metrics", &listen]);
    let s = d.socket.clone();
    let put = probe(UID_A, &s, &["put", "-", "40", &LEN.to_string()]);
    // Every put is stored: A's oldest blocks make way for its newest.
    assert_eq!(get(&put, "stored"), "40", "{put:?}");
    let b = probe(UID_B, &s, &["put", "-", "40", &LEN.to_string()]);
    assert_eq!(get(&b, "stored"), "40", "{b:?}");
    let root = d.client().stats().unwrap();
    let row = |n: &str| root.tenants.iter().find(|t| t.name == n).unwrap().clone();
    let (ra, rb) = (row("a"), row("b"));
    assert!(ra.dram_bytes <= 1 << 20, "{ra:?}");
    assert_eq!(ra.dram_bytes, 16 * LEN, "{ra:?}");
    assert_eq!(ra.dram_quota, 1 << 20);
    assert_eq!(ra.dram_quota_evictions, 24, "{ra:?}");
    assert_eq!(
        rb.dram_bytes,
        40 * LEN,
        "B is not bound by A's quota: {rb:?}"
    );
    // A's newest 16 blocks are the ones kept.
    let a = probe(UID_A, &s, &["read", "-", "40", &LEN.to_string()]);
    assert_eq!(get(&a, "inline_hits"), "16", "{a:?}");
    assert_eq!(
        get(&a, "exists"),
        "0",
        "the oldest blocks went first: {a:?}"
    );
    // Usage in `kvnode stats` and /metrics, labelled per tenant.
    let text = stats_text(&s);
    assert!(text.contains("1MiB"), "{text}");
    let m = scrape(port);
    for want in [
        "kvnode_tenant_bytes{tenant=\"a\",tier=\"dram\"} 1048576",
        "kvnode_tenant_bytes{tenant=\"b\",tier=\"dram\"} 2621440",
        "kvnode_tenant_quota_bytes{tenant=\"a\",tier=\"dram\"} 1048576",
        "kvnode_tenant_quota_evictions_total{tenant=\"a\",tier=\"dram\"} 24",
    ] {
        assert!(m.contains(want), "missing {want}:\n{m}");
    }
}

#[test]
fn the_nvme_quota_drops_the_tenants_oldest_nvme_blocks_first() {
    if !can_switch_uids() {
        return;
    }
    let spill = spill_dir("tenant-nvme");
    let d = daemon(
        "",
        "nvme_quota = \"4MiB\"",
        &[
            "--dram",
            "16MiB",
            "--spill-dir",
            spill.to_str().unwrap(),
            "--spill-size",
            "128MiB",
        ],
    );
    let len = (512u64 << 10).to_string();
    // 48 blocks of 512 KiB each (24 MiB) through a 16 MiB DRAM tier: most are demoted.
    for who in [UID_A, UID_B] {
        let put = probe(who, &d.socket, &["put", "-", "48", &len]);
        assert_eq!(get(&put, "stored"), "48", "{put:?}");
    }
    let t = Instant::now();
    loop {
        let st = d.client().stats().unwrap();
        let row = |n: &str| st.tenants.iter().find(|t| t.name == n).unwrap().clone();
        let (a, b) = (row("a"), row("b"));
        assert!(a.nvme_bytes <= 4 << 20, "A over its NVMe quota: {a:?}");
        if a.nvme_quota_evictions > 0 && b.nvme_bytes > 4 << 20 {
            assert_eq!(a.nvme_quota, 4 << 20);
            assert_eq!(b.nvme_quota_evictions, 0, "{b:?}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no NVMe quota action: {a:?} {b:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&spill);
}

#[test]
fn a_block_larger_than_the_quota_is_refused_no_space() {
    if !can_switch_uids() {
        return;
    }
    let d = daemon("", "dram_quota = \"32KiB\"", &[]);
    let put = probe(UID_A, &d.socket, &["put", "-", "2", &LEN.to_string()]);
    assert_eq!(get(&put, "no_space"), "2", "{put:?}");
    let st = d.client().stats().unwrap();
    let a = st.tenants.iter().find(|t| t.name == "a").unwrap();
    assert_eq!(a.quota_refusals, 2, "{a:?}");
}

#[test]
fn a_uid_outside_the_allowlist_is_refused_at_accept_logged_and_counted() {
    if !can_switch_uids() {
        return;
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let d = daemon(
        &format!("allow_uids = [0, {UID_A}]"),
        "",
        &["--metrics", &listen],
    );
    let ok = probe(UID_A, &d.socket, &["connect"]);
    assert_eq!(get(&ok, "connected"), "1", "{ok:?}");
    let no = probe(UID_B, &d.socket, &["connect"]);
    let err = get(&no, "connect_error");
    assert!(
        err.contains(&format!(
            "uid {UID_B} gid {UID_B} is not allowed to connect"
        )),
        "{err}"
    );
    assert!(d.log().contains("client refused at accept"), "{}", d.log());
    let m = scrape(port);
    assert!(
        m.contains("kvnode_clients_refused_total{reason=\"allowlist\"} 1"),
        "{m}"
    );
}

#[test]
fn unmapped_identities_are_refused_when_the_map_says_so() {
    if !can_switch_uids() {
        return;
    }
    // Root is mapped (to `ops`) so the harness can reach the daemon; 64003 is nobody's.
    let d = daemon(
        "[tenants]\nunmapped = \"refuse\"\n[[tenants.tenant]]\nname = \"ops\"\nuids = [0]",
        "",
        &[],
    );
    let no = probe(64003, &d.socket, &["connect"]);
    assert!(
        get(&no, "connect_error").contains("belongs to no tenant"),
        "{no:?}"
    );
    assert_eq!(d.client().stats().unwrap().refused.unmapped, 1);
}

/// Two daemons with the same map: A's blocks on daemon 1 are pulled by A's client on
/// daemon 2 and missed by B's client there, whatever salt B names.
#[test]
fn a_peer_pull_hits_within_a_tenant_and_misses_across_tenants() {
    if !can_switch_uids() {
        return;
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let adv = format!("tcp://{listen}");
    // A daemon with a tenant map opens a peer port only with a cluster key (issue 25, item 3).
    let kdir = temp_dir("tenants-key");
    let k = kdir.join("k");
    std::fs::write(&k, "tenants-cluster-key-cccccccccccccccc\n").unwrap();
    let k = k.to_str().unwrap();
    let src = daemon(
        "",
        "",
        &[
            "--peer-listen",
            &listen,
            "--advertise",
            &adv,
            "--cluster-key",
            k,
        ],
    );
    let dst = daemon("", "", &["--peers", "127.0.0.0/8", "--cluster-key", k]);
    let put = probe(UID_A, &src.socket, &["put", "p", "4", &LEN.to_string()]);
    assert_eq!(get(&put, "stored"), "4", "{put:?}");
    let keys: Vec<Key> = (0..4).map(key).collect();
    let h = hint(port, &keys);
    for salt in ["p", "-", "kvnode-tenant:a/p"] {
        let b = probe(
            UID_B,
            &dst.socket,
            &["read", salt, "4", &LEN.to_string(), &h],
        );
        assert_eq!(
            get(&b, "inline_hits"),
            "0",
            "B pulled A's blocks with salt {salt}: {b:?}"
        );
        let pull = get(&b, "pull");
        assert!(pull.contains("Missed") && !pull.contains("Pulled"), "{b:?}");
    }
    let a = probe(
        UID_A,
        &dst.socket,
        &["read", "p", "4", &LEN.to_string(), &h],
    );
    assert!(get(&a, "pull").contains("Pulled"), "{a:?}");
    assert_eq!(get(&a, "inline_same"), "4", "A's pull: {a:?}");
    assert_eq!(
        get(&a, "id"),
        get(&put, "id"),
        "one tenant, one namespace id on both daemons"
    );
}

/// KV events of a tenant's blocks carry the salt the daemon derived, and Dynamo's router,
/// hashing the tokens with that salt, computes the published hashes.
#[test]
fn published_events_carry_the_daemon_derived_salt() {
    use dynamo_kv_router::protocols::{BlockHashOptions, KvCacheEventData, WorkerWithDpRank};
    use dynamo_kv_router::zmq_wire::{ZmqEventNormalizer, decode_event_batch};
    use dynamo_kv_router::{LocalBlockHash, compute_block_hash_for_seq};

    if !can_switch_uids() {
        return;
    }
    let sockets = temp_dir("tenant-events");
    let events = format!("ipc://{}", sockets.join("ev.sock").display());
    let replay = format!("ipc://{}", sockets.join("replay.sock").display());
    let d = daemon(
        "",
        "publish_events = true",
        &[
            "--events",
            &events,
            "--events-replay",
            &replay,
            "--dp-rank",
            "0",
        ],
    );
    let put = probe(UID_A, &d.socket, &["put_meta", "s", "3"]);
    assert_eq!(get(&put, "stored"), "3", "{put:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hash = |tokens: &[u32], salt: &str| -> Vec<LocalBlockHash> {
        let opts = BlockHashOptions {
            block_mm_infos: None,
            lora_name: None,
            cache_namespace: Some(salt),
            is_eagle: None,
        };
        compute_block_hash_for_seq(tokens, 4, opts)
    };
    let t = Instant::now();
    let mut stored = Vec::new();
    while stored.len() < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "stores not published: {stored:?}"
        );
        stored.clear();
        let mut norm = ZmqEventNormalizer::new(4);
        for (i, (_, payload)) in rt.block_on(replay_all(&replay)).into_iter().enumerate() {
            for raw in decode_event_batch(&payload)
                .expect("dynamo decodes it")
                .events
            {
                let placed = norm
                    .normalize(raw, i as u64, WorkerWithDpRank::new(1, 0))
                    .expect("normalized");
                if let KvCacheEventData::Stored(s) = placed.event.data {
                    stored.extend(s.blocks.iter().map(|b| (b.block_hash.0, b.tokens_hash)));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (h, tokens_hash) in stored {
        let tokens: Vec<u32> = (0..4).map(|j| (h * 4 + j) as u32).collect();
        assert_eq!(
            vec![tokens_hash],
            hash(&tokens, "kvnode-tenant:a/s"),
            "block {h}"
        );
        assert_ne!(
            vec![tokens_hash],
            hash(&tokens, "s"),
            "block {h}: the client's salt alone"
        );
    }
}

/// A residency snapshot withholds what live events withhold: tenant B (no
/// `publish_events`) puts the same chain as tenant A, and the snapshot holds A's three
/// blocks only, under A's salt.
#[test]
fn a_snapshot_withholds_the_blocks_of_tenants_that_do_not_publish() {
    use dynamo_kv_router::protocols::{BlockHashOptions, KvCacheEventData, WorkerWithDpRank};
    use dynamo_kv_router::zmq_wire::{ZmqEventNormalizer, decode_event_batch};
    use dynamo_kv_router::{LocalBlockHash, compute_block_hash_for_seq};

    if !can_switch_uids() {
        return;
    }
    let sockets = temp_dir("tenant-snapshot");
    let events = format!("ipc://{}", sockets.join("ev.sock").display());
    let replay = format!("ipc://{}", sockets.join("replay.sock").display());
    let d = daemon(
        "",
        "publish_events = true",
        &["--events", &events, "--events-replay", &replay],
    );
    for uid in [UID_A, UID_B] {
        let put = probe(uid, &d.socket, &["put_meta", "s", "3"]);
        assert_eq!(get(&put, "stored"), "3", "{put:?}");
    }
    let e = d.client().stats().unwrap().events.unwrap();
    assert_eq!(e.withheld, 3, "B's stores are withheld: {e:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (batches, _) = rt.block_on(kvnode_e2e::snapshot::snapshot_of(&replay));
    let mut norm = ZmqEventNormalizer::new(4);
    let mut stored = Vec::new();
    for payload in batches {
        for raw in decode_event_batch(&payload)
            .expect("dynamo decodes it")
            .events
        {
            let placed = norm
                .normalize(raw, 0, WorkerWithDpRank::new(1, 0))
                .expect("normalized");
            if let KvCacheEventData::Stored(s) = placed.event.data {
                stored.extend(s.blocks.iter().map(|b| (b.block_hash.0, b.tokens_hash)));
            }
        }
    }
    let salted = |h: u64| -> Vec<LocalBlockHash> {
        let tokens: Vec<u32> = (0..4).map(|j| (h * 4 + j) as u32).collect();
        let opts = BlockHashOptions {
            block_mm_infos: None,
            lora_name: None,
            cache_namespace: Some("kvnode-tenant:a/s"),
            is_eagle: None,
        };
        compute_block_hash_for_seq(&tokens, 4, opts)
    };
    assert_eq!(stored.len(), 3, "A's blocks only: {stored:?}");
    for (h, tokens_hash) in stored {
        assert_eq!(vec![tokens_hash], salted(h), "block {h} under A's salt");
    }
}

async fn replay_all(endpoint: &str) -> Vec<(u64, bytes::Bytes)> {
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answers")
            .unwrap();
        let seq: [u8; 8] = m.get(1).unwrap()[..].try_into().unwrap();
        if i64::from_be_bytes(seq) == -1 {
            return out;
        }
        out.push((u64::from_be_bytes(seq), m.get(2).unwrap().clone()));
    }
}

#[test]
fn a_map_giving_one_uid_to_two_tenants_is_refused_at_start() {
    let dir = temp_dir("tenants-bad");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        "[[tenants.tenant]]\nname = \"a\"\nuids = [5]\n[[tenants.tenant]]\nname = \"b\"\nuids = [5]\n",
    )
    .unwrap();
    let (status, log) = Daemon::start_failing(
        &["--dram", "64MiB", "--config", cfg.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert!(!status.success());
    assert!(
        log.contains("uid 5 is listed in tenants \"a\" and \"b\": give it to one"),
        "{log}"
    );
}

fn scrape(port: u16) -> String {
    let t = Instant::now();
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut r = String::new();
            s.read_to_string(&mut r).unwrap();
            assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
            return r;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no /metrics on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
