//! How the daemon copies client regions (sealed / SIGBUS-guarded mapping / pread) and what a
//! client that shrinks its memfd can do: it gets an error and loses its region, nothing it did
//! not hold is committed, and the daemon keeps serving every other client byte-exact.
//! Run: `cargo test --release -p kvnode-e2e --test region_guard`.

use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use kvnode_client::{Client, ClientError};
use kvnode_e2e::shm::{Shm, refused};
use kvnode_e2e::{Daemon, block, key, spec};
use kvnode_proto::client::{ErrorCode, PutStatus};
use kvnode_proto::stats::RegionStats;

const PAGE: usize = 64 << 10;
const P: u64 = PAGE as u64;

fn regions(c: &mut Client) -> RegionStats {
    c.stats().unwrap().regions
}

/// Puts `keys` from pages `0..n` of `shm` (filled with `block(seed + i)`), then reads them back
/// into pages `n..2n` and checks every byte.
fn round_trip(c: &mut Client, ns: u32, shm: &mut Shm, region: u32, seed: u64, n: usize) {
    for i in 0..n {
        shm.bytes()[i * PAGE..(i + 1) * PAGE].copy_from_slice(&block(seed + i as u64, PAGE));
    }
    let keys: Vec<_> = (0..n as u64).map(|i| key(seed + i)).collect();
    let src: Vec<u64> = (0..n as u64).map(|i| i * P).collect();
    let dst: Vec<u64> = (n as u64..2 * n as u64).map(|i| i * P).collect();
    let lens = vec![P; n];
    let st = c.put_from_region(ns, &keys, region, &src, &lens).unwrap();
    assert!(st.iter().all(|s| *s == PutStatus::Stored), "{st:?}");
    let got = c.get_to_region(ns, &keys, region, &dst, &lens).unwrap();
    assert!(got.iter().all(|g| *g == Some(P)), "{got:?}");
    for i in 0..n {
        let page = &shm.bytes()[(n + i) * PAGE..(n + i + 1) * PAGE];
        assert_eq!(page, &block(seed + i as u64, PAGE)[..], "page {i}");
    }
}

#[test]
fn sealable_region_is_sealed_against_shrinking_and_moves_exact_bytes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut c = d.client();
    let ns = c.register(&spec("region", P)).unwrap().ns;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    let mut shm = Shm::with_flags("kvnode-sealable", 4 * PAGE, flags);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    // SAFETY: fcntl on our own descriptor.
    let seals = unsafe { libc::fcntl(shm.fd.as_raw_fd(), libc::F_GET_SEALS) };
    assert_ne!(
        seals & libc::F_SEAL_SHRINK,
        0,
        "attach must seal against shrinking"
    );
    assert!(!shm.truncate(0), "a sealed file cannot shrink");
    round_trip(&mut c, ns, &mut shm, region, 5, 2);
    assert_eq!(regions(&mut c).attached_sealed, 1);
}

/// The SGLang case: an unsealable memfd is mapped and guarded. The client truncates it; its
/// next get and put fault inside the daemon, are absorbed, fail with an error, commit nothing,
/// and detach the region; a second client and the first one's stored blocks are untouched.
#[test]
fn unsealable_region_is_guarded_and_a_truncating_client_only_hurts_itself() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let (mut a, mut b) = (d.client(), d.client());
    let ns = a.register(&spec("region", P)).unwrap().ns;
    assert_eq!(b.register(&spec("region", P)).unwrap().ns, ns);
    let mut sa = Shm::new("kvnode-guarded-a", 8 * PAGE);
    let mut sb = Shm::new("kvnode-guarded-b", 8 * PAGE);
    let ra = a.attach_region(sa.fd.as_fd(), sa.len as u64).unwrap();
    let rb = b.attach_region(sb.fd.as_fd(), sb.len as u64).unwrap();
    assert_eq!(regions(&mut a).attached_guarded, 2);
    round_trip(&mut a, ns, &mut sa, ra, 100, 4);
    round_trip(&mut b, ns, &mut sb, rb, 200, 4);

    // GetToRegion after the client truncated: the daemon's write faults and is absorbed.
    assert!(sa.truncate(PAGE));
    refused(
        a.get_to_region(ns, &[key(100), key(101)], ra, &[4 * P, 5 * P], &[P, P]),
        ErrorCode::Invalid,
        "shrank under the daemon",
    );
    refused(
        a.get_to_region(ns, &[key(100)], ra, &[0], &[P]),
        ErrorCode::NotOwned,
        "not attached",
    );
    // PutFromRegion from a truncated region: the daemon's read faults; nothing is committed.
    let rc = a.attach_region(sb.fd.as_fd(), sb.len as u64).unwrap();
    let fresh = Shm::new("kvnode-guarded-c", 4 * PAGE);
    let rf = b.attach_region(fresh.fd.as_fd(), fresh.len as u64).unwrap();
    assert!(fresh.truncate(0));
    refused(
        b.put_from_region(ns, &[key(300), key(301)], rf, &[0, P], &[P, P]),
        ErrorCode::Invalid,
        "nothing was stored",
    );
    assert_eq!(
        b.exists(ns, &[key(300)]).unwrap(),
        0,
        "a faulted read was committed"
    );
    assert_eq!(
        b.exists(ns, &[key(301)]).unwrap(),
        0,
        "a faulted read was committed"
    );
    let s = regions(&mut b);
    assert_eq!((s.faults, s.attached_guarded), (2, 4), "{s:?}");

    // Both connections keep working; every stored block is still byte-exact.
    let got = a.get(ns, &[key(100), key(103), key(200)]).unwrap();
    assert_eq!(got[0].as_deref(), Some(&block(100, PAGE)[..]));
    assert_eq!(got[1].as_deref(), Some(&block(103, PAGE)[..]));
    assert_eq!(got[2].as_deref(), Some(&block(200, PAGE)[..]));
    round_trip(&mut a, ns, &mut sb, rc, 400, 4);
    round_trip(&mut b, ns, &mut sb, rb, 500, 4);
    assert!(
        d.log().contains("client region faulted; detached"),
        "{}",
        d.log()
    );
}

/// A truncate that lands while the daemon is copying (many large requests in flight): every
/// request either completes or fails; whatever was stored holds the client's exact bytes.
#[test]
fn truncate_racing_region_copies_never_commits_wrong_bytes() {
    const BIG: usize = 1 << 20;
    const N: usize = 16;
    let d = Daemon::start(&["--dram", "256MiB", "--slab-size", "4MiB"]);
    let mut c = d.client();
    let ns = c.register(&spec("race", BIG as u64)).unwrap().ns;
    let mut shm = Shm::new("kvnode-race", 2 * N * BIG);
    for i in 0..N {
        shm.bytes()[i * BIG..(i + 1) * BIG].copy_from_slice(&block(i as u64, BIG));
    }
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    let offs: Vec<u64> = (0..N as u64).map(|i| i * BIG as u64).collect();
    let dst: Vec<u64> = (N as u64..2 * N as u64).map(|i| i * BIG as u64).collect();
    let lens = vec![BIG as u64; N];
    let (stored, failed) = std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let (mut stored, mut round, t0) = (Vec::new(), 0u64, Instant::now());
            loop {
                let keys: Vec<_> = (0..N as u64).map(|i| key(1000 * round + i)).collect();
                match c.put_from_region(ns, &keys, region, &offs, &lens) {
                    Ok(st) => stored.extend(keys.iter().copied().zip(0..N as u64).zip(st)),
                    Err(e) => return (stored, e),
                }
                if let Err(e) = c.get_to_region(ns, &keys, region, &dst, &lens) {
                    return (stored, e);
                }
                round += 1;
                assert!(t0.elapsed() < Duration::from_mins(1), "never failed");
            }
        });
        std::thread::sleep(Duration::from_millis(400));
        assert!(shm.truncate(BIG / 2 + 4096));
        worker.join().unwrap()
    });
    eprintln!(
        "{} blocks stored before the truncate; then: {failed}",
        stored.len()
    );
    match failed {
        ClientError::Server { code, message } => {
            assert!(
                code == ErrorCode::Invalid && message.contains("shrank under the daemon"),
                "{code:?}: {message}"
            );
        }
        other => panic!("expected the shrink error, got {other:?}"),
    }
    // A fresh client reads every block that was reported stored and is still resident (older
    // rounds are evicted from the 256 MiB tier): all exact, and the last round all resident.
    let mut v = d.client();
    assert!(!stored.is_empty(), "the truncate came before any copy");
    let last_round = stored.len().saturating_sub(N);
    for (n, &((k, i), st)) in stored.iter().enumerate() {
        assert_eq!(st, PutStatus::Stored);
        match v.get(ns, &[k]).unwrap().swap_remove(0) {
            Some(got) => assert!(got == block(i, BIG), "block of page {i} differs"),
            None => assert!(n < last_round, "the last stored round lost page {i}"),
        }
    }
    assert_eq!(regions(&mut v).faults, 1);
}

/// `--region-copy pread`: unsealable regions are copied with pread/pwrite; a shrunk file is
/// refused before anything moves and the region stays attached.
#[test]
fn without_the_guard_unsealable_regions_use_pread_and_a_shrunk_file_is_refused() {
    let d = Daemon::start(&["--dram", "64MiB", "--region-copy", "pread"]);
    let mut c = d.client();
    let ns = c.register(&spec("region", P)).unwrap().ns;
    let mut shm = Shm::new("kvnode-pread", 8 * PAGE);
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    round_trip(&mut c, ns, &mut shm, region, 7, 4);
    assert!(shm.truncate(4096));
    refused(
        c.put_from_region(ns, &[key(1)], region, &[0], &[P]),
        ErrorCode::Invalid,
        "shrank",
    );
    assert_eq!(c.exists(ns, &[key(1)]).unwrap(), 0);
    let s = regions(&mut c);
    assert_eq!((s.attached_pread, s.attached_guarded, s.faults), (1, 0, 0));
}
