//! Opening a spill file: create and preallocate, or validate its superblock and geometry.

use crate::buf::AlignedBuf;
use crate::error::{DecodeError, SpillError};
use crate::format::{SECTOR, SUPERBLOCK_LEN, Superblock};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// An open spill file with its validated superblock.
#[derive(Debug)]
pub(crate) struct SpillFile {
    pub path: PathBuf,
    pub file: File,
    pub sb: Superblock,
    /// True when the file was (re)initialised empty at this open.
    pub fresh: bool,
}

fn is_einval(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Reads `buf.len()` bytes at `off`, zero-filling past end of file. Short reads are retried.
pub(crate) fn read_full(file: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn random_uuid() -> [u8; 16] {
    let mut u = [0u8; 16];
    // SAFETY: writes at most 16 bytes into `u`.
    let n = unsafe { libc::getrandom(u.as_mut_ptr().cast(), u.len(), 0) };
    if n != 16 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        u = (t ^ u128::from(std::process::id())).to_le_bytes();
    }
    u
}

fn fallocate(file: &File, size: u64) -> std::io::Result<()> {
    loop {
        // SAFETY: plain syscall on an owned fd.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size.cast_signed()) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn write_superblock(file: &File, path: &Path, sb: &Superblock) -> Result<(), SpillError> {
    let mut sector = AlignedBuf::zeroed(SECTOR as usize);
    sector[..SUPERBLOCK_LEN].copy_from_slice(&sb.encode());
    match file.write_all_at(&sector, 0) {
        Ok(()) => {}
        Err(e) if is_einval(&e) => {
            return Err(SpillError::DirectIoUnsupported {
                path: path.into(),
                source: e,
            });
        }
        Err(e) => return Err(SpillError::io("writing the superblock", path, e)),
    }
    file.sync_data()
        .map_err(|e| SpillError::io("fdatasync", path, e))
}

/// Truncates `file`, preallocates it and writes `sb`. On failure the file is removed again:
/// it is still locked by us, so nobody else uses it, and it holds nothing.
fn init_empty(file: File, path: &Path, sb: Superblock) -> Result<SpillFile, SpillError> {
    let written = file
        .set_len(0)
        .map_err(|e| SpillError::io("truncating spill file", path, e))
        .and_then(|()| {
            fallocate(&file, sb.file_size).map_err(|source| SpillError::Preallocate {
                path: path.into(),
                size: sb.file_size,
                source,
            })
        })
        .and_then(|()| write_superblock(&file, path, &sb));
    if let Err(e) = written {
        if let Err(rm) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %rm, "could not remove the spill file after a failed initialisation");
        }
        return Err(e);
    }
    Ok(SpillFile {
        path: path.into(),
        file,
        sb,
        fresh: true,
    })
}

/// Opens (creating if needed) the spill file at `path` with the given geometry, and locks it
/// exclusively for as long as the returned file stays open (see `lock.rs`).
///
/// A file whose superblock has our magic but is otherwise damaged, or whose first sector is
/// all zeroes (a start that died between preallocation and the superblock write), is
/// reinitialised empty (its blocks become misses); a file without our magic is refused so
/// that a wrong path never overwrites foreign data. When initialising fails (e.g. the
/// device is too small for the preallocation) the file is removed again, so no zero-filled
/// file is left to fill the disk and block the next start.
pub(crate) fn open_spill_file(
    path: &Path,
    index: u32,
    file_size: u64,
    region_size: u64,
    direct: bool,
) -> Result<SpillFile, SpillError> {
    let f = open_checked(path, index, file_size, region_size, direct)?;
    crate::perms::tighten(&f.file, path)?;
    Ok(f)
}

/// Opens (or creates) the file at `path` private to this user, refusing a symbolic link,
/// and takes its exclusive lock.
fn open_locked(path: &Path, direct: bool) -> Result<File, SpillError> {
    let mut opts = OpenOptions::new();
    // O_NOFOLLOW: a symlink planted at the path is refused (ELOOP), never followed.
    opts.read(true)
        .write(true)
        .create(true)
        .mode(crate::perms::FILE_MODE);
    let flags = if direct { libc::O_DIRECT } else { 0 } | libc::O_NOFOLLOW;
    opts.custom_flags(flags);
    match opts.open(path) {
        Ok(f) => {
            crate::perms::private_file(&f, path)?;
            crate::lock::lock_exclusive(&f, path)?;
            Ok(f)
        }
        Err(e) if direct && is_einval(&e) => Err(SpillError::DirectIoUnsupported {
            path: path.into(),
            source: e,
        }),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(SpillError::Insecure {
            path: path.into(),
            why: "it is a symbolic link".into(),
        }),
        Err(e) => Err(SpillError::io("opening spill file", path, e)),
    }
}

fn open_checked(
    path: &Path,
    index: u32,
    file_size: u64,
    region_size: u64,
    direct: bool,
) -> Result<SpillFile, SpillError> {
    if let Some(dir) = path.parent() {
        crate::perms::private_dir(dir)?;
    }
    let file = open_locked(path, direct)?;
    let len = file
        .metadata()
        .map_err(|e| SpillError::io("stat", path, e))?
        .len();
    let fresh_sb = Superblock {
        block_align: SECTOR as u32,
        file_size,
        region_size,
        file_index: index,
        uuid: random_uuid(),
    };
    let init = |file: File| init_empty(file, path, fresh_sb);
    if len == 0 {
        return init(file);
    }
    let mut sector = AlignedBuf::zeroed(SECTOR as usize);
    match read_full(&file, &mut sector, 0) {
        Ok(()) => {}
        Err(e) if is_einval(&e) => {
            return Err(SpillError::DirectIoUnsupported {
                path: path.into(),
                source: e,
            });
        }
        Err(e) => return Err(SpillError::io("reading the superblock", path, e)),
    }
    if sector.iter().all(|&b| b == 0) {
        tracing::warn!(path = %path.display(), "spill file has an all-zero superblock (a start that stopped before writing it); reinitialising it empty");
        return init(file);
    }
    match Superblock::decode(&sector) {
        Ok(sb) if sb.file_size == file_size && sb.region_size == region_size => {
            if len < file_size {
                tracing::warn!(path = %path.display(), len, "spill file is shorter than its geometry; extending (blocks past the cut are lost)");
                fallocate(&file, file_size).map_err(|e| {
                    SpillError::io("fallocate (extending a short spill file)", path, e)
                })?;
            }
            Ok(SpillFile {
                path: path.into(),
                file,
                sb,
                fresh: false,
            })
        }
        Ok(sb) => Err(SpillError::GeometryMismatch {
            path: path.into(),
            found: format!(
                "file size {} and region size {}",
                sb.file_size, sb.region_size
            ),
            configured: format!("file size {file_size} and region size {region_size}"),
        }),
        Err(
            source @ (DecodeError::Magic { .. }
            | DecodeError::Truncated { .. }
            | DecodeError::Version { .. }),
        ) => Err(SpillError::NotASpillFile {
            path: path.into(),
            source,
        }),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "spill superblock damaged; reinitialising the file empty");
            init(file)
        }
    }
}
