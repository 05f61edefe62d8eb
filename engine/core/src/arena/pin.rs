//! Background population and pinning of the arena, chunk by chunk, with progress logs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Arena;

/// What the background pass does.
#[derive(Debug, Clone, Copy)]
pub struct PinOptions {
    /// mlock each chunk.
    pub pin: bool,
    /// Fault each chunk in (implied by `pin`).
    pub populate: bool,
    /// Chunk size (progress granularity and stop latency).
    pub chunk: u64,
}

fn memlock_limit() -> String {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &raw mut r) } != 0 {
        return "unknown".into();
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        kvnode_proto::size::ByteSize(r.rlim_cur).to_string()
    }
}

fn populate(ptr: *mut u8, len: usize) {
    // MADV_POPULATE_WRITE (Linux 5.14+); on older kernels touch one byte per page.
    // SAFETY: advising a range of our own mapping.
    if unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) } == 0 {
        return;
    }
    for off in (0..len).step_by(4096) {
        // SAFETY: in-bounds volatile read; a read fault allocates the shmem page and leaves
        // the bytes unchanged whatever a concurrent writer does.
        unsafe { std::ptr::read_volatile(ptr.add(off)) };
    }
}

pub(super) fn run(arena: &Arena, opts: PinOptions, stop: &AtomicBool) {
    let p = arena.progress();
    let total = arena.len();
    let start = Instant::now();
    let mut last_log = Instant::now();
    let mut pin = opts.pin;
    let mut off = 0u64;
    while off < total && !stop.load(Ordering::Relaxed) {
        let len = opts.chunk.min(total - off);
        // SAFETY: off + len <= arena length.
        let ptr = unsafe { arena.base().add(off as usize) };
        if pin {
            // SAFETY: locking a range of our own mapping.
            if unsafe { libc::mlock(ptr.cast(), len as usize) } == 0 {
                p.pinned.fetch_add(len, Ordering::Relaxed);
            } else {
                let err = std::io::Error::last_os_error();
                tracing::warn!(
                    error = %err,
                    memlock_limit = %memlock_limit(),
                    pinned = p.pinned.load(Ordering::Relaxed),
                    "cannot pin the DRAM arena; running unpinned. Raise RLIMIT_MEMLOCK \
                     (`ulimit -l unlimited`, or LimitMEMLOCK=infinity in the systemd unit) \
                     or grant CAP_IPC_LOCK, or set pin = false to silence this"
                );
                p.refused.store(true, Ordering::Relaxed);
                pin = false;
            }
        }
        if !pin && opts.populate {
            populate(ptr, len as usize);
        }
        off += len;
        p.populated.store(off, Ordering::Relaxed);
        if last_log.elapsed() >= Duration::from_secs(2) {
            last_log = Instant::now();
            tracing::info!(
                done_pct = off * 100 / total,
                pinned = p.pinned.load(Ordering::Relaxed),
                populated = off,
                "arena population in progress"
            );
        }
    }
    p.done.store(true, Ordering::Relaxed);
    tracing::info!(
        pinned = p.pinned.load(Ordering::Relaxed),
        populated = p.populated.load(Ordering::Relaxed),
        secs = start.elapsed().as_secs_f64(),
        stopped_early = stop.load(Ordering::Relaxed),
        "arena population finished"
    );
}
