//! Pins the SIGBUS guard against a file owner that truncates: guarded copies over pages the
//! file no longer backs return `Faulted` (before or racing the copy, from several threads,
//! nested) and the process survives; faults outside a guarded access stay fatal, and a SIGBUS
//! handler installed before ours still gets the faults that are not ours.
//! Run: `cargo test --release -p kvnode-shmguard`.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvnode_shmguard::{AccessError, SharedMapping, install, installed};

const MIB: usize = 1 << 20;

/// An unsealable memfd (`MFD_CLOEXEC` only, as SGLang 0.5.23 creates its host pool).
fn memfd(len: usize) -> OwnedFd {
    // SAFETY: valid NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"shmguard-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create");
    // SAFETY: fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    truncate(&fd, len);
    fd
}

/// Installs the guard (once per process) and maps `fd`.
fn map(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> std::io::Result<SharedMapping> {
    install()?;
    SharedMapping::map(fd, len)
}

fn truncate(fd: &OwnedFd, len: usize) {
    // SAFETY: valid descriptor.
    assert_eq!(
        unsafe { libc::ftruncate(fd.as_raw_fd(), libc::off_t::try_from(len).unwrap()) },
        0
    );
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn copies_inside_a_whole_file_are_byte_exact() {
    let fd = memfd(4 * MIB);
    let m = map(fd.as_fd(), 4 * MIB).unwrap();
    let src = pattern(MIB, 7);
    let mut back = vec![0u8; MIB];
    m.guarded(|g| {
        g.write(3 * MIB, &src).unwrap();
        g.read(3 * MIB, &mut back).unwrap();
        assert!(
            g.write(3 * MIB + 1, &src).is_err(),
            "out of range must be refused"
        );
    })
    .unwrap();
    assert_eq!(back, src);
    assert!(!m.is_poisoned());
}

#[test]
fn write_after_truncate_returns_faulted_and_later_accesses_fail_too() {
    let fd = memfd(4 * MIB);
    let m = map(fd.as_fd(), 4 * MIB).unwrap();
    truncate(&fd, 0);
    let src = pattern(MIB, 1);
    assert_eq!(m.guarded(|g| g.write(MIB, &src)), Err(AccessError::Faulted));
    assert!(m.is_poisoned());
    // The mapping is replaced: nothing reaches the (re-grown) file any more.
    truncate(&fd, 4 * MIB);
    let ran = AtomicBool::new(false);
    let r = m.guarded(|_| ran.store(true, Ordering::Relaxed));
    assert_eq!(r, Err(AccessError::Faulted));
    assert!(
        !ran.load(Ordering::Relaxed),
        "a poisoned mapping must not run the access"
    );
}

#[test]
fn read_across_the_truncation_point_returns_faulted() {
    let fd = memfd(4 * MIB);
    let m = map(fd.as_fd(), 4 * MIB).unwrap();
    m.guarded(|g| g.write(0, &pattern(4 * MIB, 3)).unwrap())
        .unwrap();
    truncate(&fd, 2 * MIB);
    let mut dst = vec![0u8; 2 * MIB];
    // Below the new end of file: still fine.
    m.guarded(|g| g.read(0, &mut dst).unwrap()).unwrap();
    assert_eq!(dst, pattern(4 * MIB, 3)[..2 * MIB]);
    // Straddling it: the copy faults half way and is reported, not trusted.
    let r = m.guarded(|g| g.read(MIB, &mut dst));
    assert_eq!(r, Err(AccessError::Faulted));
}

#[test]
fn truncate_racing_copies_on_several_threads_faults_them_all_and_the_process_survives() {
    let fd = memfd(16 * MIB);
    let m = map(fd.as_fd(), 16 * MIB).unwrap();
    let copies = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..3u8)
            .map(|t| {
                let (m, copies) = (&m, &copies);
                s.spawn(move || {
                    let src = pattern(16 * MIB, t);
                    let mut dst = vec![0u8; 16 * MIB];
                    let t0 = Instant::now();
                    loop {
                        let r = if t % 2 == 0 {
                            m.guarded(|g| g.write(0, &src).unwrap())
                        } else {
                            m.guarded(|g| g.read(0, &mut dst).unwrap())
                        };
                        if r == Err(AccessError::Faulted) {
                            return;
                        }
                        copies.fetch_add(1, Ordering::Relaxed);
                        assert!(t0.elapsed() < Duration::from_secs(30), "never faulted");
                    }
                })
            })
            .collect();
        while copies.load(Ordering::Relaxed) < 6 {
            std::thread::yield_now();
        }
        truncate(&fd, 4096);
        for w in workers {
            w.join().unwrap();
        }
    });
    assert!(m.is_poisoned());
}

#[test]
fn nested_access_charges_the_fault_to_the_mapping_that_faulted() {
    let (fa, fb) = (memfd(MIB), memfd(MIB));
    let a = map(fa.as_fd(), MIB).unwrap();
    let b = map(fb.as_fd(), MIB).unwrap();
    truncate(&fb, 0);
    let src = pattern(MIB, 9);
    let outer = a.guarded(|ga| {
        ga.write(0, &src).unwrap();
        b.guarded(|gb| gb.write(0, &src).unwrap())
    });
    assert_eq!(outer, Ok(Err(AccessError::Faulted)));
    assert!(!a.is_poisoned() && b.is_poisoned());
    let mut back = vec![0u8; MIB];
    a.guarded(|g| g.read(0, &mut back).unwrap()).unwrap();
    assert_eq!(back, src);
}

/// Runs one of the `child_*` scenarios below in a fresh process; returns its exit status.
fn in_child(scenario: &str) -> std::process::ExitStatus {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_scenario",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SHMGUARD_CHILD", scenario)
        .status()
        .unwrap()
}

#[test]
fn a_fault_outside_any_guarded_access_still_kills_the_process() {
    let st = in_child("unguarded");
    assert_eq!(st.signal(), Some(libc::SIGBUS), "{st:?}");
}

#[test]
fn a_sigbus_sent_by_another_process_is_not_swallowed() {
    let st = in_child("sent");
    assert_eq!(st.signal(), Some(libc::SIGBUS), "{st:?}");
}

#[test]
fn a_handler_installed_before_ours_still_gets_faults_that_are_not_ours() {
    let st = in_child("chained");
    assert_eq!(st.code(), Some(0), "{st:?}");
}

static PREVIOUS_RAN: AtomicUsize = AtomicUsize::new(0);

/// A pre-existing SIGBUS user that recovers by mapping a zero page over the faulting page.
extern "C" fn previous_handler(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    PREVIOUS_RAN.fetch_add(1, Ordering::SeqCst);
    // SAFETY: kernel-provided siginfo; mapping over the faulting page of our own test mapping.
    unsafe {
        let page = (*info).si_addr() as usize & !4095;
        libc::mmap(
            page as *mut libc::c_void,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
    }
}

/// Not a test of its own: the body of `in_child` processes (does nothing when run normally).
#[test]
fn child_scenario() {
    let Ok(which) = std::env::var("SHMGUARD_CHILD") else {
        return;
    };
    let fd = memfd(MIB);
    match which.as_str() {
        "unguarded" => {
            install().unwrap();
            let raw = plain_map(&fd);
            truncate(&fd, 0);
            // SAFETY: deliberately touching a truncated page with no guarded access: must die.
            unsafe { raw.write_volatile(1) };
            std::process::exit(3);
        }
        "sent" => {
            // No earlier handler (std's would swallow a sent SIGBUS): the default action.
            // SAFETY: resetting SIGBUS to its default before anything is installed.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
            let m = map(fd.as_fd(), MIB).unwrap();
            // Sent by a process (si_code <= 0) while an access is active: still delivered.
            let _ = m.guarded(|_| {
                // SAFETY: raise has no preconditions.
                unsafe { libc::raise(libc::SIGBUS) };
            });
            std::process::exit(3);
        }
        "chained" => {
            // SAFETY: zeroed sigaction is valid; installing a test handler before ours.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = previous_handler as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_SIGINFO;
                assert_eq!(
                    libc::sigaction(libc::SIGBUS, &raw const sa, std::ptr::null_mut()),
                    0
                );
            }
            let m = map(fd.as_fd(), MIB).unwrap();
            let raw = plain_map(&fd);
            truncate(&fd, 0);
            // Ours first: a guarded fault is absorbed, the earlier handler never sees it.
            assert_eq!(
                m.guarded(|g| g.write(0, &[1; 64]).unwrap()),
                Err(AccessError::Faulted)
            );
            assert_eq!(PREVIOUS_RAN.load(Ordering::SeqCst), 0);
            // Not ours: handed to the earlier handler, which recovers.
            // SAFETY: touching a truncated page; the earlier handler maps a page over it.
            unsafe { raw.write_volatile(1) };
            assert_eq!(PREVIOUS_RAN.load(Ordering::SeqCst), 1);
            // Ours is then out of the way, and says so instead of copying unguarded.
            assert!(!installed());
            let m2 = map(memfd(MIB).as_fd(), MIB).unwrap();
            assert_eq!(m2.guarded(|_| ()), Err(AccessError::Unguarded));
            std::process::exit(0);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn plain_map(fd: &OwnedFd) -> *mut u8 {
    // SAFETY: mapping our own memfd of MIB bytes (leaked for the child's lifetime).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            MIB,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}
