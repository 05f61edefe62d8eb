//! Client memory regions against a real daemon: a test-owned memfd is attached with
//! SCM_RIGHTS, blocks move between it and the tier byte-exactly, every bad offset, length or
//! descriptor is refused with nothing written, and the mapping dies with the connection.
//! Run: `cargo test --release -p kvnode-e2e --test region`.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use kvnode_client::{Client, ClientError};
use kvnode_e2e::{Daemon, block, key, spec};
use kvnode_proto::client::{ErrorCode, PutStatus};

const PAGE: usize = 64 << 10;

/// A memfd of `len` bytes mapped into the test, like SGLang's `"allocator": "shm"` host pool.
struct Shm {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

impl Shm {
    fn new(name: &str, len: usize) -> Self {
        Self::with_flags(name, len, libc::MFD_CLOEXEC)
    }

    fn with_flags(name: &str, len: usize, flags: libc::c_uint) -> Self {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: valid NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c.as_ptr(), flags) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        assert_eq!(
            unsafe { libc::ftruncate(raw, libc::off_t::try_from(len).unwrap()) },
            0
        );
        // SAFETY: mapping our own memfd of `len` bytes.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        Self {
            fd,
            base: base.cast(),
            len,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: our own mapping; the daemon only writes it during a request we wait on.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn refused(r: Result<impl std::fmt::Debug, ClientError>, code: ErrorCode, needle: &str) {
    match r {
        Err(ClientError::Server { code: c, message }) => {
            assert_eq!(c, code, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        other => panic!("expected {code:?} error, got {other:?}"),
    }
}

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
    // A region whose file shrank is refused instead of crashing the daemon with SIGBUS.
    let region = c.attach_region(shm.fd.as_fd(), PAGE as u64).unwrap();
    // SAFETY: valid fd.
    assert_eq!(unsafe { libc::ftruncate(shm.fd.as_raw_fd(), 4096) }, 0);
    let ns = c.register(&spec("region", PAGE as u64)).unwrap().ns;
    refused(
        c.put_from_region(ns, &[key(1)], region, &[0], &[PAGE as u64]),
        ErrorCode::Invalid,
        "shrank",
    );
    assert_eq!(c.exists(ns, &[key(1)]).unwrap(), 0);
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

/// A sealable memfd is sealed against shrinking at attach (so the daemon copies through its
/// mapping and a client truncation cannot fault it); an unsealable one (every other test here)
/// is copied with pread/pwrite, which fail instead of faulting. Both move exact bytes.
#[test]
fn sealable_region_is_sealed_against_shrinking_and_moves_exact_bytes() {
    let d = Daemon::start(&["--dram", "64MiB"]);
    let mut c = d.client();
    let ns = c.register(&spec("region", PAGE as u64)).unwrap().ns;
    let mut shm = Shm::with_flags(
        "kvnode-sealable",
        4 * PAGE,
        libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
    );
    let region = c.attach_region(shm.fd.as_fd(), shm.len as u64).unwrap();
    // SAFETY: fcntl on our own descriptor.
    let seals = unsafe { libc::fcntl(shm.fd.as_raw_fd(), libc::F_GET_SEALS) };
    assert_ne!(
        seals & libc::F_SEAL_SHRINK,
        0,
        "attach must seal the file against shrinking"
    );
    // SAFETY: as above.
    assert_ne!(
        unsafe { libc::ftruncate(shm.fd.as_raw_fd(), 0) },
        0,
        "a sealed file cannot shrink"
    );
    shm.bytes()[..PAGE].copy_from_slice(&block(5, PAGE));
    let st = c
        .put_from_region(ns, &[key(5)], region, &[0], &[PAGE as u64])
        .unwrap();
    assert_eq!(st, vec![PutStatus::Stored]);
    let got = c
        .get_to_region(ns, &[key(5)], region, &[2 * PAGE as u64], &[PAGE as u64])
        .unwrap();
    assert_eq!(got, vec![Some(PAGE as u64)]);
    assert_eq!(&shm.bytes()[2 * PAGE..3 * PAGE], &block(5, PAGE)[..]);
}
