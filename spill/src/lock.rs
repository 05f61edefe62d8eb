//! The exclusive lock every open spill file holds for the tier's life.
//!
//! `flock(LOCK_EX | LOCK_NB)` on the spill file's own descriptor, taken before anything
//! reads or changes the file and released only when that descriptor closes (tier dropped,
//! or the process gone, however it ended). A second daemon on the same directory, or the
//! same file reached twice in one configuration (two paths to one directory), is refused
//! at open instead of both writing one file. The lock belongs to the open file
//! description, so two opens inside one process conflict as well.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::SpillError;

/// Locks `file` (at `path`) exclusively, or says who holds it.
pub(crate) fn lock_exclusive(file: &File, path: &Path) -> Result<(), SpillError> {
    loop {
        // SAFETY: plain syscall on a descriptor `file` owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) => {
                return Err(SpillError::Locked {
                    path: path.into(),
                    holder: holder_pid(file),
                });
            }
            _ => return Err(SpillError::io("flock (locking the spill file)", path, e)),
        }
    }
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
}
