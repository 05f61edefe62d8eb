//! The process-wide SIGBUS handler and the per-thread stack of guarded accesses it consults.
//!
//! Invariants the handler relies on:
//! - `ACTIVE` is a `const`-initialised thread-local `Cell` of a raw pointer (no destructor, no
//!   lazy init), so reading it from a signal handler is a plain TLS load (async-signal-safe).
//! - Every `Access` on the chain lives on the stack of the thread that pushed it and is popped
//!   (by `Entry`'s `Drop`, unwinding included) before that frame ends, in LIFO order.
//! - An `Access` points at a `SharedMapping` that outlives it (it borrows it for the access).
//! - `PREVIOUS` is written before our handler is installed and never again.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{Ordering, compiler_fence};

use crate::SharedMapping;

/// One guarded access in progress on this thread: the mapping, and the access it nests in.
pub(crate) struct Access {
    mapping: *const SharedMapping,
    prev: Cell<*const Access>,
}

thread_local! {
    /// Innermost guarded access of this thread (null: none).
    static ACTIVE: Cell<*const Access> = const { Cell::new(std::ptr::null()) };
}

/// The disposition SIGBUS had before ours, handed back on a fault that is not ours.
struct Previous(libc::sigaction);

// SAFETY: plain data (handler address, mask, flags), written once before any reader exists.
unsafe impl Sync for Previous {}
// SAFETY: as above.
unsafe impl Send for Previous {}

static PREVIOUS: OnceLock<Previous> = OnceLock::new();
static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();

impl Access {
    pub(crate) fn new(mapping: &SharedMapping) -> Self {
        Self {
            mapping: std::ptr::from_ref(mapping),
            prev: Cell::new(std::ptr::null()),
        }
    }
}

/// Makes `access` this thread's innermost guarded access until the `Entry` drops.
pub(crate) struct Entry<'a> {
    access: &'a Access,
}

impl<'a> Entry<'a> {
    pub(crate) fn push(access: &'a Access) -> Self {
        ACTIVE.with(|a| {
            access.prev.set(a.get());
            a.set(std::ptr::from_ref(access));
        });
        // The handler (same thread) must see the record before the first copy instruction.
        compiler_fence(Ordering::SeqCst);
        Self { access }
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        // Every copy of the access is done before the record leaves the chain.
        compiler_fence(Ordering::SeqCst);
        ACTIVE.with(|a| a.set(self.access.prev.get()));
        compiler_fence(Ordering::SeqCst);
    }
}

/// Installs the SIGBUS handler once per process (later calls return the first outcome).
///
/// The disposition found at installation (in a Rust binary: std's stack-overflow handler) is
/// kept and handed back on any SIGBUS that is not a guarded access's.
pub fn install() -> std::io::Result<()> {
    let r = INSTALLED.get_or_init(|| {
        // SAFETY: zeroed sigaction is a valid out-parameter; querying has no side effect.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointers; a null new action only reads the current one.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &raw mut old) } != 0 {
            return Err(errno());
        }
        // Written before the handler exists, so the handler always finds it.
        let _ = PREVIOUS.set(Previous(old));
        // SAFETY: zeroed sigaction is valid; every field we rely on is set below.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: valid sigset pointer.
        unsafe { libc::sigemptyset(&raw mut new.sa_mask) };
        // SAFETY: valid action; the handler only does async-signal-safe work (see on_sigbus).
        if unsafe { libc::sigaction(libc::SIGBUS, &raw const new, std::ptr::null_mut()) } != 0 {
            return Err(errno());
        }
        Ok(())
    });
    (*r).map_err(std::io::Error::from_raw_os_error)
}

/// Whether our handler is SIGBUS's disposition right now (one `sigaction` query).
///
/// False before `install`, after a foreign SIGBUS made the handler hand the signal back, or
/// when another component replaced the disposition.
pub fn installed() -> bool {
    if INSTALLED.get().is_none_or(Result::is_err) {
        return false;
    }
    // SAFETY: zeroed sigaction is a valid out-parameter; querying has no side effect.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers; a null new action only reads the current one.
    let ok = unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &raw mut cur) } == 0;
    ok && cur.sa_sigaction == on_sigbus as *const () as libc::sighandler_t
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EINVAL)
}

/// SIGBUS handler. Async-signal-safe: TLS load, atomics, `mmap`, `sigaction`, `raise`, errno.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; the interrupted code must find it unchanged.
    let saved_errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo with SA_SIGINFO.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // si_code > 0: raised by a fault (si_addr is meaningful), not sent by kill/raise.
    if code > 0 && absorb(addr) {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = saved_errno };
        return;
    }
    // Not ours: put the previous disposition back. A fault re-executes the instruction on
    // return and is delivered to it; a sent signal is sent again (blocked until we return).
    // SAFETY: sigaction/signal/raise are async-signal-safe; PREVIOUS is immutable once set.
    unsafe {
        if let Some(p) = PREVIOUS.get() {
            libc::sigaction(sig, &raw const p.0, std::ptr::null_mut());
        } else {
            libc::signal(sig, libc::SIG_DFL);
        }
        if code <= 0 {
            libc::raise(sig);
        }
    }
}

/// If `addr` lies in a mapping under guarded access on this thread: poisons it, replaces its
/// pages with private zero pages (the faulting copy then completes harmlessly) and says true.
fn absorb(addr: usize) -> bool {
    let mut a = ACTIVE.with(Cell::get);
    while !a.is_null() {
        // SAFETY: records on the chain are alive (module invariants).
        let access = unsafe { &*a };
        // SAFETY: the access borrows its mapping, so the mapping is alive.
        let m = unsafe { &*access.mapping };
        let base = m.base.as_ptr() as usize;
        if addr >= base && addr < base + m.len {
            // Poisoned before the pages change: any thread that can observe the zero pages
            // (mmap below, with its TLB shootdown, happens after this store) sees the flag
            // when it checks after its copy.
            m.poisoned.store(true, Ordering::SeqCst);
            // SAFETY: replaces exactly our own mapping's range; nothing else lives there while
            // the mapping is borrowed. MAP_NORESERVE: only pages the copy touches are charged.
            let r = unsafe {
                libc::mmap(
                    m.base.as_ptr().cast(),
                    m.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            return r != libc::MAP_FAILED;
        }
        a = access.prev.get();
    }
    false
}
