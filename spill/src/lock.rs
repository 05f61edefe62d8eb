//! The exclusive lock every open spill file holds for the tier's life.
//!
//! `flock(LOCK_EX | LOCK_NB)` on the spill file's own descriptor, taken before anything
//! reads or changes the file and released only when that descriptor closes (tier dropped,
//! or the process gone, however it ended). A second daemon on the same directory, or the
//! same file reached twice in one configuration (two paths to one directory), is refused
//! at open instead of both writing one file. The lock belongs to the open file
//! description, so two opens inside one process conflict as well.
//!
//! A killed daemon's lock can outlive the daemon: its io_uring holds the file until the
//! kernel has finished the ring's in-flight IO and torn the ring down, after the process
//! has exited. A restart right after a SIGKILL (systemd's `Restart=`, `kvnode bench spill`)
//! would be refused for a lock nobody holds any more, so while the process that took the
//! lock is gone (or /proc/locks names none) the open waits for it, up to
//! [`DEAD_HOLDER_WAIT`]; a live holder is refused at once.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::SpillError;

/// How long an open waits for a lock whose holder has exited.
pub(crate) const DEAD_HOLDER_WAIT: Duration = Duration::from_secs(10);

/// Locks `file` (at `path`) exclusively, or says who holds it.
pub(crate) fn lock_exclusive(file: &File, path: &Path) -> Result<(), SpillError> {
    let start = Instant::now();
    let mut told = false;
    while !try_lock(file, path)? {
        let holder = holder_pid(file);
        if holder.is_some_and(alive) || start.elapsed() >= DEAD_HOLDER_WAIT {
            return Err(SpillError::Locked {
                path: path.into(),
                holder,
            });
        }
        if !told {
            told = true;
            tracing::info!(path = %path.display(), ?holder, wait_s = DEAD_HOLDER_WAIT.as_secs(),
                "spill file locked by a process that has exited (its IO still draining): waiting for the lock");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Waits (at most `limit`) until no open file description holds the lock on `path`: takes
/// it on a description of its own, then lets it go. A path that cannot be opened has no
/// holder to wait for.
pub(crate) fn wait_released(path: &Path, limit: Duration) {
    let start = Instant::now();
    let Ok(file) = File::open(path) else { return };
    while !try_lock(&file, path).unwrap_or(true) {
        if start.elapsed() >= limit {
            tracing::warn!(path = %path.display(), "spill file still locked after the tier closed");
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // Closing `file` releases the lock just taken.
}

/// One `flock` try: `Ok(false)` while another open description holds the lock.
fn try_lock(file: &File, path: &Path) -> Result<bool, SpillError> {
    loop {
        // SAFETY: plain syscall on a descriptor `file` owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(SpillError::io("flock (locking the spill file)", path, e)),
        }
    }
}

/// Whether `pid` is a running process (a zombie has closed its files already).
fn alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')'.
    let state = stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

/// The pid /proc/locks names for an flock on `file`'s inode (the process that took it).
fn holder_pid(file: &File) -> Option<u32> {
    let md = file.metadata().ok()?;
    let dev = md.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        md.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // e.g. "3: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF"
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (kind, pid, id) = (f.get(1)?, f.get(4)?, f.get(5)?);
        (*kind == "FLOCK" && id.eq_ignore_ascii_case(&want))
            .then(|| pid.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_of_a_locked_file_is_refused_and_names_this_process() {
        let dir = std::env::temp_dir().join(format!("kvnode-spill-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let a = File::create(&path).unwrap();
        lock_exclusive(&a, &path).unwrap();
        let b = File::options().read(true).write(true).open(&path).unwrap();
        match lock_exclusive(&b, &path) {
            Err(SpillError::Locked { holder, .. }) => {
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(a);
        lock_exclusive(&b, &path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file under a fresh directory of this test's own.
    fn scratch(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("kvnode-spill-lock-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        File::create(&path).unwrap();
        (dir, path)
    }

    /// Waits until someone else holds the lock on `path`, and `ready` says it is set up.
    fn wait_held(f: &File, path: &Path, ready: impl Fn(Option<u32>) -> bool) -> Option<u32> {
        let t = Instant::now();
        loop {
            assert!(t.elapsed() < Duration::from_secs(10), "lock never taken");
            if try_lock(f, path).unwrap() {
                // SAFETY: plain syscall on a descriptor `f` owns.
                unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
            } else if ready(holder_pid(f)) {
                return holder_pid(f);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_live_holder_in_another_process_is_refused_at_once() {
        let (dir, path) = scratch("live");
        // util-linux flock(1) (Essential on Debian) takes the lock and waits for `sleep`.
        let mut holder = std::process::Command::new("flock")
            .args(["-x"])
            .arg(&path)
            .args(["sleep", "30"])
            .spawn()
            .expect("flock(1) from util-linux");
        let f = File::options().read(true).write(true).open(&path).unwrap();
        wait_held(&f, &path, |h| h == Some(holder.id()));
        let t = Instant::now();
        match lock_exclusive(&f, &path) {
            Err(SpillError::Locked { holder: h, .. }) => assert_eq!(h, Some(holder.id())),
            other => panic!("expected Locked, got {other:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "a live holder must not be waited for"
        );
        holder.kill().unwrap();
        holder.wait().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The killed daemon's case: the process that took the lock is gone, but its open file
    /// description lives on (here in `sleep`, which inherited it; in a daemon, in the ring
    /// the kernel is still tearing down). The open waits and gets the lock once it closes.
    #[test]
    fn a_lock_whose_taker_has_exited_is_waited_for_until_released() {
        let (dir, path) = scratch("dead");
        let mut keeper = std::process::Command::new("bash")
            .args(["-c", r#"exec 9<>"$1" && flock -x 9 && exec sleep 30"#, "_"])
            .arg(&path)
            .spawn()
            .unwrap();
        let f = File::options().read(true).write(true).open(&path).unwrap();
        let taker = wait_held(&f, &path, |h| h.is_some_and(|p| !alive(p)));
        assert_ne!(
            taker,
            Some(keeper.id()),
            "the lock's taker is flock(1), not the keeper"
        );
        let pid = keeper.id();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: plain syscall; `pid` is our child, not yet waited for.
            unsafe { libc::kill(pid.cast_signed(), libc::SIGKILL) };
        });
        let t = Instant::now();
        lock_exclusive(&f, &path).expect("the lock, once the description closed");
        let waited = t.elapsed();
        release.join().unwrap();
        keeper.wait().unwrap();
        assert!(
            waited >= Duration::from_millis(250),
            "took a lock still held ({waited:?})"
        );
        assert!(
            waited < DEAD_HOLDER_WAIT,
            "waited the whole bound ({waited:?})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
