//! A client the tenant e2e tests run as another uid (`tests/tests/tenants.rs`): it connects
//! to a daemon, does one scripted thing and prints `key value` lines for the test to check.
//!
//! `tenant_probe SOCKET connect`
//! `tenant_probe SOCKET put SALT N LEN`          register (model `tenant-model`), put blocks 0..N
//! `tenant_probe SOCKET read SALT N LEN [HINT]`  register, then exists / inline get / lease get
//! `tenant_probe SOCKET put_meta SALT N`        put a chain of N 4-token pages with router metadata
//! `tenant_probe SOCKET handle H N`              use handle H without registering it
//! `tenant_probe SOCKET stats`                   the stats (and histograms) as this client sees them
//! A SALT of `-` means none.

use kvnode_client::Client;
use kvnode_e2e::{block, key, spec};
use kvnode_proto::Key;
use kvnode_proto::client::{BlockMeta, PutStatus};

fn out(k: &str, v: impl std::fmt::Display) {
    println!("{k} {v}");
}

fn one_line(e: impl std::fmt::Display) -> String {
    e.to_string().replace('\n', " ")
}

fn register(c: &mut Client, salt: &str, len: u64) -> u32 {
    let mut s = spec("tenant-model", len);
    if salt != "-" {
        salt.clone_into(&mut s.tenant_salt);
    }
    let r = c.register(&s).expect("register");
    out("ns", r.ns);
    out("id", &r.id);
    r.ns
}

fn reads(c: &mut Client, ns: u32, keys: &[Key], len: usize, hint: Option<&str>) {
    if let Some(h) = hint {
        match c.get_hinted(ns, keys, Some(h), Some(5000)) {
            Ok((_, report)) => out("pull", format!("{report:?}").replace('\n', " ")),
            Err(e) => out("pull_error", one_line(e)),
        }
    }
    match c.exists(ns, keys) {
        Ok(n) => out("exists", n),
        Err(e) => out("exists_error", one_line(e)),
    }
    match c.get(ns, keys) {
        Ok(got) => {
            let hits = got.iter().flatten().count();
            let same = got
                .iter()
                .enumerate()
                .filter(|(i, g)| g.as_deref() == Some(block(*i as u64, len).as_slice()))
                .count();
            out("inline_hits", hits);
            out("inline_same", same);
        }
        Err(e) => out("inline_error", one_line(e)),
    }
    match c.get_lease(ns, keys) {
        Ok(l) => {
            out("lease_hits", l.extents.iter().flatten().count());
            if l.id != 0 {
                let _ = c.release(l.id);
            }
        }
        Err(e) => out("lease_error", one_line(e)),
    }
}

/// The stats (and histograms) as this client sees them.
fn stats(c: &mut Client) {
    let s = c.stats().expect("stats");
    let names: Vec<&str> = s.tenants.iter().map(|t| t.name.as_str()).collect();
    out("tenants", names.join(","));
    out("namespaces", s.namespaces.len());
    for t in &s.tenants {
        out(&format!("dram_bytes.{}", t.name), t.dram_bytes);
        out(&format!("refusals.{}", t.name), t.quota_refusals);
    }
    for t in &s.tiers {
        out(&format!("tier_blocks.{}", t.tier), t.blocks);
        out(&format!("tier_hits.{}", t.tier), t.hits);
    }
    out("pools", s.pools.len());
    out("clients", s.clients);
    out("events", s.events.is_some());
    match c.histograms() {
        Ok(h) => out("histograms", h.histograms.len()),
        Err(e) => out("histograms_error", one_line(e)),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let socket = &args[1];
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    out("uid", uid);
    out("gid", gid);
    let mut c = match Client::connect(socket) {
        Ok(c) => c,
        Err(e) => {
            out("connect_error", one_line(e));
            return;
        }
    };
    out("arena_bytes", c.arena().len());
    let num = |i: usize| -> u64 { args[i].parse().expect("a number") };
    match args[2].as_str() {
        "connect" => out("connected", 1),
        "put" => {
            let (n, len) = (num(4), num(5));
            let ns = register(&mut c, &args[3], len);
            let mut stored = 0;
            let mut no_space = 0;
            for i in 0..n {
                let b = block(i, len as usize);
                match c.put(ns, &[key(i)], &[b.as_slice()]).expect("put")[0] {
                    PutStatus::Stored => stored += 1,
                    PutStatus::NoSpace => no_space += 1,
                    other => panic!("put {i}: {other:?}"),
                }
            }
            out("stored", stored);
            out("no_space", no_space);
        }
        "put_meta" => {
            let mut s = spec("tenant-events", 4096);
            s.page_size = 4;
            if args[3] != "-" {
                args[3].clone_into(&mut s.tenant_salt);
            }
            let ns = c.register(&s).expect("register").ns;
            let n = num(4);
            let keys: Vec<Key> = (0..n).map(key).collect();
            let data: Vec<Vec<u8>> = (0..n).map(|i| block(i, 4096)).collect();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let meta = (0..n)
                .map(|i| {
                    Some(BlockMeta {
                        tokens: (0..4).map(|j| (i * 4 + j) as u32).collect(),
                        parent: i.checked_sub(1).map(|p| key(p).0),
                    })
                })
                .collect();
            let r = c.put_with_meta(ns, &keys, &refs, meta).expect("put");
            out(
                "stored",
                r.iter().filter(|s| **s == PutStatus::Stored).count(),
            );
        }
        "read" => {
            let (n, len) = (num(4), num(5));
            let ns = register(&mut c, &args[3], len);
            let keys: Vec<Key> = (0..n).map(key).collect();
            reads(
                &mut c,
                ns,
                &keys,
                len as usize,
                args.get(6).map(String::as_str),
            );
        }
        "handle" => {
            let ns = u32::try_from(num(3)).expect("a handle");
            let keys: Vec<Key> = (0..num(4)).map(key).collect();
            reads(&mut c, ns, &keys, 0, None);
            match c.delete(ns, &keys) {
                Ok(n) => out("deleted", n),
                Err(e) => out("delete_error", one_line(e)),
            }
            act_on(&mut c, ns, &keys);
            let b = block(0, 4096);
            match c.put(ns, &keys[..1], &[b.as_slice()]) {
                Ok(r) => out("put", format!("{r:?}")),
                Err(e) => out("put_error", one_line(e)),
            }
            match c.clear(None) {
                Ok(n) => out("cleared", n),
                Err(e) => out("clear_error", one_line(e)),
            }
        }
        "stats" => stats(&mut c),
        other => panic!("unknown action {other}"),
    }
}

/// A router action on the handle: evict, and retain (to pin DRAM against its owner).
fn act_on(c: &mut Client, ns: u32, keys: &[Key]) {
    let hashes: Vec<String> = keys.iter().map(|k| k.0.router_hash().to_string()).collect();
    let env = format!(
        r#"{{"protocol_version":"1.0","message_id":"x","actions":[{{"action_id":"e","action_type":"kv.evict","action_version":"1.0","payload":{{"block_hashes":{hashes:?}}}}},{{"action_id":"r","action_type":"kv.retain","action_version":"1.0","payload":{{"block_hashes":{hashes:?},"ttl_seconds":60}}}}]}}"#
    );
    match c.act(ns, keys, &env) {
        Ok(r) => out("act", format!("{r:?}")),
        Err(e) => out("act_error", one_line(e)),
    }
}
