//! Shared helpers for the spill integration tests: temp dirs, keys, patterned data, arenas.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use kvnode_spill::{FaultPlan, IoBuf, IoEngineKind, ReadOutcome, SpillConfig, SpillKey, SpillTier};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A directory removed on drop. `base` must be on a real disk for `O_DIRECT` (e.g. /var/tmp).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(base: &str) -> Self {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let p = Path::new(base).join(format!("kvnode-spill-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    pub fn disk() -> Self {
        Self::new("/var/tmp")
    }
    pub fn shm() -> Self {
        Self::new("/dev/shm")
    }
    pub fn file(&self) -> PathBuf {
        self.0.join(kvnode_spill::SPILL_FILE_NAME)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn key(i: u64) -> SpillKey {
    let mut digest = [0u8; 32];
    digest[..8].copy_from_slice(&i.to_le_bytes());
    SpillKey {
        namespace: 0xABCD,
        digest,
        segment: (i % 7) as u16,
    }
}

/// Deterministic bytes for block `i` of length `len`.
pub fn data(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Small geometry: 1 MiB regions, 256 KiB max block.
/// io_uring with the faults of `plan` injected.
pub fn faulty(plan: FaultPlan) -> IoEngineKind {
    IoEngineKind::Faulty {
        inner: Box::new(IoEngineKind::Uring),
        plan,
    }
}

pub fn small(dir: &Path, size: u64, engine: IoEngineKind) -> kvnode_spill::SpillConfigBuilder {
    SpillConfig::builder()
        .dir(dir, size)
        .engine(engine)
        .region_size(1 << 20)
        .max_block_size(256 << 10)
        .queue_depth(8)
}

pub fn write_vec(t: &SpillTier, i: u64, len: usize) -> kvnode_spill::WriteOutcome {
    let done = t.write(key(i), IoBuf::Vec(data(i, len))).wait();
    done.result.expect("write")
}

/// Reads block `i` into a Vec; returns the outcome and the bytes.
pub fn read_vec(t: &SpillTier, i: u64) -> (ReadOutcome, Vec<u8>) {
    let done = t.read(key(i), IoBuf::Vec(Vec::new())).wait();
    let out = done.result.expect("read");
    let IoBuf::Vec(v) = done.buf else {
        panic!("buffer kind changed")
    };
    (out, v)
}

/// Asserts block `i` reads back as exactly `data(i, len)`.
pub fn assert_block(t: &SpillTier, i: u64, len: usize) {
    let (out, v) = read_vec(t, i);
    assert_eq!(out, ReadOutcome::Hit { len }, "block {i}");
    assert!(v == data(i, len), "block {i} bytes differ");
}

/// An anonymous page-aligned mapping standing in for the engine's arena.
pub struct Mapping {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Mapping {
    pub fn new(len: usize) -> Self {
        // SAFETY: anonymous private mapping, checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self { ptr: p.cast(), len }
    }
    pub fn slice(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of a live mapping owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping created in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Whether a test that needs root may run: true as root; otherwise panics, unless
/// `KVNODE_TEST_ALLOW_SKIP` lists `root` (or `all`), which skips it loudly (false).
pub fn require_root(why: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let allowed = std::env::var("KVNODE_TEST_ALLOW_SKIP").unwrap_or_default();
    assert!(
        allowed.split(',').any(|w| w == "root" || w == "all"),
        "this test needs root ({why}); run the suite as root, or set KVNODE_TEST_ALLOW_SKIP=root to skip it on purpose"
    );
    eprintln!("\n!!!!! SKIPPING (KVNODE_TEST_ALLOW_SKIP): needs root for {why} !!!!!\n");
    false
}
