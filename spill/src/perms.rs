//! Who may read a spill file: its directory is created `0700` and the file `0600`, whatever
//! the process umask, so no other local uid reads a demoted block past the client socket's
//! mode, `allow_uids` or the tenant map.
//!
//! Existing paths, decided per risk:
//! - a directory or file owned by another uid, a directory others may write (they could
//!   swap the file between two starts), or a symlink in place of the file: **refused**
//!   ([`SpillError::Insecure`]);
//! - a directory others may read or search (it shows only the file's name): a loud warning;
//! - a file of ours that others may read or write (made by an older kvnode, or copied in):
//!   tightened to `0600` with a loud warning, since the daemon owns it.

use crate::error::SpillError;
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

/// Mode of the spill directories kvnode creates.
pub(crate) const DIR_MODE: u32 = 0o700;
/// Mode of the spill files kvnode creates.
pub(crate) const FILE_MODE: u32 = 0o600;

fn insecure(path: &Path, why: String) -> SpillError {
    SpillError::Insecure {
        path: path.into(),
        why,
    }
}

fn euid() -> u32 {
    // SAFETY: geteuid never fails.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (and missing parents) `0700` when absent, then checks it: this daemon's uid
/// or root owns it, group and others may not write it; warns when they may read it.
pub(crate) fn private_dir(dir: &Path) -> Result<(), SpillError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|e| SpillError::io("creating spill dir", dir, e))?;
    let md = std::fs::metadata(dir).map_err(|e| SpillError::io("stat spill dir", dir, e))?;
    let me = euid();
    if md.uid() != me && md.uid() != 0 {
        return Err(insecure(
            dir,
            format!(
                "the spill directory belongs to uid {}, not to this daemon (uid {me}) or root",
                md.uid()
            ),
        ));
    }
    let mode = md.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(insecure(
            dir,
            format!(
                "the spill directory has mode {mode:04o}: other users may create, rename or replace files in it (chmod go-w, or 0700)"
            ),
        ));
    }
    if mode & 0o055 != 0 {
        tracing::warn!(
            path = %dir.display(),
            mode = format!("{mode:04o}"),
            "SPILL DIRECTORY IS READABLE BY OTHER USERS: the spill file inside is 0600, but `chmod 0700` the directory"
        );
    }
    Ok(())
}

/// Checks the spill file just opened (with `O_NOFOLLOW`, created `0600`): a regular file
/// owned by this daemon's uid.
pub(crate) fn private_file(file: &File, path: &Path) -> Result<(), SpillError> {
    let md = file
        .metadata()
        .map_err(|e| SpillError::io("stat", path, e))?;
    if !md.file_type().is_file() {
        return Err(insecure(path, "it is not a regular file".into()));
    }
    let me = euid();
    if md.uid() != me {
        return Err(insecure(
            path,
            format!(
                "the spill file belongs to uid {}, not to this daemon (uid {me}): that user could read every block written to it",
                md.uid()
            ),
        ));
    }
    Ok(())
}

/// Removes group and other permissions from a spill file kvnode has accepted as its own
/// (a foreign file it refuses is left as it is), with a loud warning.
pub(crate) fn tighten(file: &File, path: &Path) -> Result<(), SpillError> {
    let md = file
        .metadata()
        .map_err(|e| SpillError::io("stat", path, e))?;
    let mode = md.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
            .map_err(|e| SpillError::io("chmod 0600 of the spill file", path, e))?;
        tracing::warn!(
            path = %path.display(),
            mode = format!("{mode:04o}"),
            "SPILL FILE WAS READABLE OR WRITABLE BY OTHER USERS: its mode is now 0600; blocks written before may have been read"
        );
    }
    Ok(())
}
