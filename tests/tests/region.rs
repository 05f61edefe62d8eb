//! Client memory regions against a real daemon: a test-owned memfd is attached with
//! SCM_RIGHTS, blocks move between it and the tier byte-exactly, every bad offset, length or
//! descriptor is refused with nothing written, and the mapping dies with the connection.
//! Copy modes and clients that shrink their memfd: region_guard.rs.
//! Run: `cargo test --release -p kvnode-e2e --test region`.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use kvnode_client::Client;
use kvnode_e2e::shm::{Shm, refused};
use kvnode_e2e::{Daemon, block, key, spec};
use kvnode_proto::client::{ErrorCode, PutStatus};

const PAGE: usize = 64 << 10;

fn setup(d: &Daemon, pages: usize) -> (Client, u32, Shm, u32) {
    let mut c = d.client();
    let ns = c.register(&spec("region", PAGE as u64)).unwrap().ns;
    let shm = Shm::new("kvnode-test-region", pages * PAGE);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    (c, ns, shm, region)
}

#[test]
fn put_from_region_then_get_to_region_moves_exact_bytes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let (mut c, ns, mut shm, region) = setup(&d, 16);
    let keys: Vec<_> = (0..8).map(key).collect();
    for i in 0..8 {
        shm.bytes()[i * PAGE..(i + 1) * PAGE].copy_from_slice(&block(i as u64, PAGE));
    }
    let offs: Vec<u64> = (0..8).map(|i| (i * PAGE) as u64).collect();
    let lens = vec![PAGE as u64; 8];
    let st = c.put_from_region(ns, &keys, region, &offs, &lens).unwrap();
    assert!(st.iter().all(|s| *s == PutStatus::Stored), "{st:?}");
    // Inline get agrees with what was in the client's pages.
    let got = c.get(ns, &keys[..2]).unwrap();
    assert_eq!(got[1].as_deref(), Some(&block(1, PAGE)[..]));
    // Read back into the upper half, in reverse order, with one miss in the middle.
    let mut ask: Vec<_> = keys.iter().rev().copied().collect();
    ask[3] = key(999);
    let dst: Vec<u64> = (8..16).map(|i| (i * PAGE) as u64).collect();
    let hits = c.get_to_region(ns, &ask, region, &dst, &lens).unwrap();
    for (j, h) in hits.iter().enumerate() {
        let page = &shm.bytes()[(8 + j) * PAGE..(9 + j) * PAGE];
        if j == 3 {
            assert_eq!(*h, None);
            assert!(page.iter().all(|&b| b == 0), "a miss wrote bytes");
        } else {
            assert_eq!(*h, Some(PAGE as u64));
            assert_eq!(page, &block(7 - j as u64, PAGE)[..], "page {j}");
        }
    }
    c.detach_region(region).unwrap();
    refused(
        c.get_to_region(ns, &keys[..1], region, &[0], &[PAGE as u64]),
        ErrorCode::NotOwned,
        "not attached",
    );
}

#[test]
fn bad_extents_are_refused_and_nothing_is_written() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let (mut c, ns, mut shm, region) = setup(&d, 4);
    let keys = [key(1), key(2)];
    shm.bytes()[..2 * PAGE].copy_from_slice(&[block(1, PAGE), block(2, PAGE)].concat());
    let p = PAGE as u64;
    let len = shm.len as u64;
    // Past the end, by the offset or by the length; u64 overflow.
    for (offs, lens) in [
        (vec![0, len - p + 1], vec![p, p]),
        (vec![0, p], vec![p, len]),
        (vec![0, u64::MAX], vec![p, p]),
    ] {
        refused(
            c.put_from_region(ns, &keys, region, &offs, &lens),
            ErrorCode::Invalid,
            "outside",
        );
    }
    refused(
        c.put_from_region(ns, &keys, region, &[0], &[p, p]),
        ErrorCode::Invalid,
        "one offset",
    );
    assert_eq!(
        c.exists(ns, &keys).unwrap(),
        0,
        "a refused put stored something"
    );
    // Now store them, then refuse reads that would overlap or overflow their room.
    c.put_from_region(ns, &keys, region, &[0, p], &[p, p])
        .unwrap();
    shm.bytes()[2 * PAGE..].fill(0xee);
    refused(
        c.get_to_region(ns, &keys, region, &[2 * p, 2 * p + 8], &[p, p]),
        ErrorCode::Invalid,
        "overlap",
    );
    refused(
        c.get_to_region(ns, &keys, region, &[2 * p, 3 * p], &[p, p - 1]),
        ErrorCode::Invalid,
        "room",
    );
    refused(
        c.get_to_region(ns, &keys, region, &[2 * p, 3 * p + 1], &[p, p]),
        ErrorCode::Invalid,
        "outside",
    );
    refused(
        c.get_to_region(ns, &keys, 77, &[0, p], &[p, p]),
        ErrorCode::NotOwned,
        "not attached",
    );
    assert!(
        shm.bytes()[2 * PAGE..].iter().all(|&b| b == 0xee),
        "a refused get wrote into the region"
    );
    // The connection still works.
    let hits = c
        .get_to_region(ns, &keys, region, &[2 * p, 3 * p], &[p, p])
        .unwrap();
    assert_eq!(hits, vec![Some(p), Some(p)]);
    assert_eq!(&shm.bytes()[3 * PAGE..], &block(2, PAGE)[..]);
}

#[test]
fn bad_descriptors_are_refused() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut c = d.client();
    let shm = Shm::new("kvnode-test-small", PAGE);
    refused(
        c.attach_region(shm.fd.as_fd(), 2 * PAGE as u64),
        ErrorCode::Invalid,
        "fewer than",
    );
    refused(
        c.attach_region(shm.fd.as_fd(), 0),
        ErrorCode::Invalid,
        "at least 1",
    );
    // A read-only descriptor of the same memfd cannot be mapped for writing.
    let path = format!("/proc/self/fd/{}", shm.fd.as_raw_fd());
    let ro = std::fs::File::open(path).unwrap();
    refused(
        c.attach_region(ro.as_fd(), PAGE as u64),
        ErrorCode::Invalid,
        "O_RDWR",
    );
    // A pipe is not a file.
    let mut p = [0i32; 2];
    // SAFETY: valid out array.
    assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors we own.
    let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    refused(c.attach_region(r.as_fd(), 1), ErrorCode::Invalid, "memfd");
}

#[test]
fn region_mapping_is_released_when_the_connection_closes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let maps = || std::fs::read_to_string(format!("/proc/{}/maps", d.child.id())).unwrap();
    let mut c = d.client();
    let shm = Shm::new("kvnode-test-lifetime-7f3a", PAGE);
    c.attach_region(shm.fd.as_fd(), PAGE as u64).unwrap();
    assert!(maps().contains("kvnode-test-lifetime-7f3a"));
    drop(c);
    let t = Instant::now();
    while maps().contains("kvnode-test-lifetime-7f3a") {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "daemon still maps the region after disconnect"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
