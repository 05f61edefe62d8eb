//! Attacks that grow the daemon with router metadata (issue 25 item 4). Pins: a namespace
//! cannot declare a page size above 16 Ki tokens; one put cannot carry more than 1 Mi
//! metadata tokens; and a flood of small blocks each carrying the largest metadata is
//! charged to its tenant, whose live metadata is capped at 1/16 of its DRAM allowance, so
//! the daemon's memory stays flat (the blocks are stored, the excess metadata dropped and
//! counted in `kvnode_meta_dropped_total`).
//! Run: `cargo test --release -p kvnode-e2e --test attack_meta`.

use std::io::{Read, Write};

use kvnode_e2e::{Daemon, free_port, key, spec};
use kvnode_proto::client::{BlockMeta, PutStatus};

const PAGE: u32 = 16 << 10;
const LEN: usize = 4096;

fn anon_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("RssAnon")
}

fn with_events(extra: &[&str]) -> Daemon {
    let dir = kvnode_e2e::temp_dir("meta-events");
    let events = format!("ipc://{}", dir.join("ev.sock").display());
    let mut args = vec![
        "--dram",
        "64MiB",
        "--no-pin",
        "--no-populate",
        "--events",
        &events,
    ];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

fn meta(n: usize) -> BlockMeta {
    BlockMeta {
        tokens: vec![7; n],
        parent: None,
    }
}

#[test]
fn page_size_and_metadata_per_request_are_bounded() {
    let d = with_events(&[]);
    let mut c = d.client();
    let mut s = spec("meta", LEN as u64);
    s.page_size = 1_000_000;
    let e = c.register(&s).unwrap_err().to_string();
    assert!(e.contains("page_size 1000000"), "{e}");
    s.page_size = PAGE;
    let ns = c.register(&s).unwrap().ns;
    // 65 keys of 16 Ki tokens: over 1 Mi tokens in one request.
    let keys: Vec<_> = (0..65).map(key).collect();
    let b = vec![1u8; LEN];
    let blocks: Vec<&[u8]> = keys.iter().map(|_| b.as_slice()).collect();
    let metas = keys.iter().map(|_| Some(meta(PAGE as usize))).collect();
    let e = c
        .put_with_meta(ns, &keys, &blocks, metas)
        .unwrap_err()
        .to_string();
    assert!(e.contains("metadata tokens in one request"), "{e}");
    assert_eq!(
        c.exists(ns, &keys).unwrap(),
        0,
        "nothing stored by the refused put"
    );
}

#[test]
fn a_flood_of_maximal_metadata_is_charged_and_capped() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let d = with_events(&["--metrics", &listen]);
    let mut c = d.client();
    let mut s = spec("meta", LEN as u64);
    s.page_size = PAGE;
    let ns = c.register(&s).unwrap().ns;
    let mut before = 0;
    // 4000 blocks of 4 KiB (16 MiB of arena) carrying 64 KiB of token ids each: 250 MiB of
    // metadata if kept, 4 MiB at most under the cap (64 MiB / 16).
    let b = vec![3u8; LEN];
    for batch in 0..100u64 {
        let keys: Vec<_> = (batch * 40..batch * 40 + 40).map(key).collect();
        let blocks: Vec<&[u8]> = keys.iter().map(|_| b.as_slice()).collect();
        let metas = keys.iter().map(|_| Some(meta(PAGE as usize))).collect();
        let r = c.put_with_meta(ns, &keys, &blocks, metas).unwrap();
        assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
        if batch == 0 {
            // After one request: the allocator holds what one request needs.
            before = anon_kib(d.child.id());
        }
    }
    let grown = anon_kib(d.child.id()).saturating_sub(before);
    assert!(grown < 64 << 10, "daemon RSS grew by {} MiB", grown >> 10);
    let mut h = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    h.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut m = String::new();
    h.read_to_string(&mut m).unwrap();
    let dropped: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("kvnode_meta_dropped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no kvnode_meta_dropped_total:\n{m}"));
    assert!(dropped >= 3900, "dropped {dropped}");
}
