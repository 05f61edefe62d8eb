//! Round trips through a real daemon: put/get/exists/delete/clear, inline and zero-copy,
//! several concurrent clients, and namespace isolation. Run: `cargo test --release -p kvnode-e2e`.

use kvnode_client::kvnode_proto::client::{AllocSlot, CommitStatus, Extent, PutStatus};
use kvnode_e2e::{Daemon, block, key, spec};
use kvnode_proto::Key;

#[test]
fn inline_and_zero_copy_round_trips_are_byte_exact() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut c = d.client();
    let ns = c.register(&spec("m", 64 << 10)).unwrap().ns;
    let keys: Vec<Key> = (0..20).map(key).collect();
    let data: Vec<Vec<u8>> = (0..20)
        .map(|i| block(i, 1000 + i as usize * 3000))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let err = c
        .put(ns + 7, &keys[..1], &refs[..1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown namespace"), "{err}");
    let r = c.put(ns, &keys, &refs).unwrap();
    assert!(r.iter().all(|s| *s == PutStatus::Stored), "{r:?}");
    // Inline.
    let got = c.get(ns, &keys).unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.as_deref(), Some(data[i].as_slice()), "block {i}");
    }
    // Zero copy: a lease on arena extents read through this client's own mapping.
    let lease = c.get_lease(ns, &keys).unwrap();
    for (i, e) in lease.extents.iter().enumerate() {
        assert_eq!(c.arena().read(e.unwrap()), data[i].as_slice());
    }
    c.release(lease.id).unwrap();
    // Exists counts the leading run; a gap stops it.
    let mut probe = keys.clone();
    assert_eq!(c.exists(ns, &probe).unwrap(), 20);
    probe.insert(5, key(999));
    assert_eq!(c.exists(ns, &probe).unwrap(), 5);
    // Delete and clear really remove, and say how many.
    assert_eq!(c.delete(ns, &keys[..3]).unwrap(), 3);
    assert_eq!(c.delete(ns, &keys[..3]).unwrap(), 0);
    assert_eq!(c.exists(ns, &keys).unwrap(), 0);
    assert_eq!(c.clear(Some(ns)).unwrap(), 17);
    assert_eq!(c.clear(Some(ns)).unwrap(), 0);
    assert!(c.get(ns, &keys).unwrap().iter().all(Option::is_none));
    let s = c.stats().unwrap();
    assert_eq!(s.tiers[0].blocks, 0);
    assert_eq!(s.tiers[0].leases, 0);
    assert_eq!(s.namespaces[0].hits, 40);
}

#[test]
fn alloc_fill_commit_publishes_client_written_bytes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut writer = d.client();
    let ns = writer.register(&spec("m", 1 << 20)).unwrap().ns;
    let keys: Vec<Key> = (0..4).map(key).collect();
    let slots = writer.alloc(ns, &keys, &[1 << 20; 4]).unwrap();
    let mut handles = Vec::new();
    for (i, s) in slots.iter().enumerate() {
        let AllocSlot::Granted {
            handle,
            offset,
            len,
        } = *s
        else {
            panic!("{s:?}")
        };
        writer
            .arena()
            .write(Extent { offset, len })
            .copy_from_slice(&block(i as u64, len as usize));
        handles.push(handle);
    }
    // Not visible before commit.
    let mut reader = d.client();
    let ns_r = reader.register(&spec("m", 1 << 20)).unwrap().ns;
    assert_eq!(reader.exists(ns_r, &keys).unwrap(), 0);
    assert_eq!(
        writer.commit(&handles[..3]).unwrap(),
        vec![CommitStatus::Committed; 3]
    );
    assert_eq!(writer.abort(&handles[3..]).unwrap(), 1);
    assert_eq!(
        writer.commit(&handles[3..]).unwrap(),
        vec![CommitStatus::UnknownHandle]
    );
    // Another client (another rank) sees the bytes: a node-level hit with no transfer.
    let got = reader.get(ns_r, &keys).unwrap();
    for (i, g) in got.iter().take(3).enumerate() {
        assert_eq!(g.as_deref(), Some(block(i as u64, 1 << 20).as_slice()));
    }
    assert!(got[3].is_none());
}

#[test]
fn concurrent_clients_each_see_exact_bytes() {
    let d = Daemon::start(&["--dram", "128MiB"]);
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let d = &d;
            s.spawn(move || {
                let mut c = d.client();
                let ns = c.register(&spec("shared", 32 << 10)).unwrap().ns;
                for round in 0..50u64 {
                    let ids: Vec<u64> = (0..8).map(|j| t * 10_000 + round * 8 + j).collect();
                    let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                    let data: Vec<Vec<u8>> = ids.iter().map(|&i| block(i, 32 << 10)).collect();
                    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                    c.put(ns, &keys, &refs).unwrap();
                    let zero_copy = round % 2 == 0;
                    if zero_copy {
                        let l = c.get_lease(ns, &keys).unwrap();
                        for (e, want) in l.extents.iter().zip(&data) {
                            assert_eq!(c.arena().read(e.unwrap()), want.as_slice());
                        }
                        c.release(l.id).unwrap();
                    } else {
                        let got = c.get(ns, &keys).unwrap();
                        for (g, want) in got.iter().zip(&data) {
                            assert_eq!(g.as_deref(), Some(want.as_slice()));
                        }
                    }
                }
            });
        }
    });
    let s = d.client().stats().unwrap();
    assert_eq!(s.tiers[0].blocks, 6 * 50 * 8);
    assert_eq!(s.tiers[0].leases, 0);
}

#[test]
fn namespaces_with_same_digests_never_see_each_others_bytes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut c = d.client();
    let a = c.register(&spec("model-a", 4096)).unwrap();
    let mut sb = spec("model-a", 4096);
    sb.layout = "page_first_direct".into();
    let b = c.register(&sb).unwrap();
    assert_ne!(a.id, b.id);
    let keys: Vec<Key> = (0..8).map(key).collect();
    let da: Vec<Vec<u8>> = (0..8).map(|i| block(i, 4096)).collect();
    let ra: Vec<&[u8]> = da.iter().map(Vec::as_slice).collect();
    c.put(a.ns, &keys, &ra).unwrap();
    assert_eq!(c.exists(b.ns, &keys).unwrap(), 0);
    assert!(c.get(b.ns, &keys).unwrap().iter().all(Option::is_none));
    let db: Vec<Vec<u8>> = (100..108).map(|i| block(i, 4096)).collect();
    let rb: Vec<&[u8]> = db.iter().map(Vec::as_slice).collect();
    c.put(b.ns, &keys, &rb).unwrap();
    let ga = c.get(a.ns, &keys).unwrap();
    let gb = c.get(b.ns, &keys).unwrap();
    for i in 0..8 {
        assert_eq!(ga[i].as_deref(), Some(da[i].as_slice()));
        assert_eq!(gb[i].as_deref(), Some(db[i].as_slice()));
    }
    assert_eq!(c.clear(Some(a.ns)).unwrap(), 8);
    assert_eq!(c.exists(b.ns, &keys).unwrap(), 8);
}
