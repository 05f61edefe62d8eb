//! Binding an `ipc://` endpoint so that only the configured owner and group can ever connect.
//!
//! ```text
//!  check DIR: not writable by group/others, owned by us or root (else refuse)
//!  DIR/.kvnode-events-<pid>-<n>/  (mkdir 0700: nobody else can reach inside)
//!      bind "s" -> chmod mode -> chown :group -> rename to DIR/NAME -> rmdir
//! ```
//!
//! A Unix socket is reachable under its path from the moment `bind` creates it, with a mode
//! taken from the umask; binding straight at the final path would leave a window in which
//! any local user connects and keeps the connection (and every event after it). Binding in
//! a private directory and renaming the finished socket into place leaves no such window.
//! The returned [`IpcPath`] removes the socket file when the publisher stops, if it is still
//! the one this daemon created.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Default for [`Access::ipc_mode`]: the daemon's user only.
pub const DEFAULT_IPC_MODE: u32 = 0o600;

/// Who may read the events: the transport's access control.
///
/// Events carry every announced block's exact prompt token ids and its tenant salt, so the
/// channel decides who reads other tenants' prompts. `ipc://` sockets are created with
/// `ipc_mode` and `ipc_group` before anyone can connect ([`bind`]); a `tcp://`
/// endpoint has no access control at all (the pure-Rust ZMTP stack speaks only the NULL
/// mechanism, and Dynamo's listener offers no CURVE keys), so it is refused unless
/// `tcp_readable_by_anyone` says the network is trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Mode of every `ipc://` socket file: owner and group bits only (connecting needs
    /// write permission, so a reading group needs `0o660`). Default [`DEFAULT_IPC_MODE`].
    pub ipc_mode: u32,
    /// Group of every `ipc://` socket file (the router's group, with `ipc_mode = 0o660`);
    /// the daemon must be a member. Default `None`: the daemon's own group.
    pub ipc_group: Option<u32>,
    /// Allow `tcp://` endpoints, which anyone who reaches the port reads (other local
    /// users included). Default `false`.
    pub tcp_readable_by_anyone: bool,
}

impl Default for Access {
    fn default() -> Self {
        Self {
            ipc_mode: DEFAULT_IPC_MODE,
            ipc_group: None,
            tcp_readable_by_anyone: false,
        }
    }
}

/// Why an `ipc://` endpoint could not be bound.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// The socket's directory may be written by others, who could replace the socket.
    #[error(
        "the KV events socket directory {dir} has mode {mode:04o} and owner uid {owner}: \
         another user could replace the socket. Use a directory only the daemon's user (or \
         root) owns and writes (e.g. /run/kvnode, mode 0755 or 0750)"
    )]
    SharedDir {
        /// The directory.
        dir: PathBuf,
        /// Its mode.
        mode: u32,
        /// Its owner.
        owner: u32,
    },
    /// Something that is not a socket sits at the path.
    #[error("{0} exists and is not a socket: remove it or choose another ipc:// path")]
    NotASocket(PathBuf),
    /// Another process serves the path.
    #[error("{0} is in use by a running process (another kvnode?): stop it or choose another path")]
    InUse(PathBuf),
    /// The socket could not be given the configured group.
    #[error(
        "cannot give {path} group {gid}: the daemon must be root or a member of that group \
         ({source})"
    )]
    Group {
        /// The socket path.
        path: PathBuf,
        /// The configured group.
        gid: u32,
        /// The system's error.
        source: io::Error,
    },
    /// Creating, binding, chmod or rename failed.
    #[error("cannot create the KV events socket {path}: {source}")]
    Io {
        /// The path being created.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> IpcError + '_ {
    move |source| IpcError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The socket file this publisher created; removed on drop if it is still that file.
#[derive(Debug)]
pub struct IpcPath {
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for IpcPath {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Refuses a directory that others may write or that another user owns.
fn check_dir(dir: &Path) -> Result<(), IpcError> {
    let md = std::fs::metadata(dir).map_err(io_err(dir))?;
    let mode = md.permissions().mode() & 0o7777;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if mode & 0o022 != 0 || (md.uid() != me && md.uid() != 0) {
        return Err(IpcError::SharedDir {
            dir: dir.to_owned(),
            mode,
            owner: md.uid(),
        });
    }
    Ok(())
}

/// Removes a stale socket at `path`; refuses anything else, or a socket someone serves.
fn clear_stale(path: &Path) -> Result<(), IpcError> {
    let Ok(md) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !std::os::unix::fs::FileTypeExt::is_socket(&md.file_type()) {
        return Err(IpcError::NotASocket(path.to_owned()));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(IpcError::InUse(path.to_owned()));
    }
    std::fs::remove_file(path).map_err(io_err(path))
}

/// A private directory next to the socket; removed (with what is left in it) on drop.
struct Staging(PathBuf);

impl Staging {
    fn new(dir: &Path) -> Result<Self, IpcError> {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = dir.join(format!(
            ".kvnode-events-{}-{}",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        let mut b = std::fs::DirBuilder::new();
        b.mode(0o700);
        if b.create(&p).is_err() {
            // Left by an earlier process with this pid: it is ours (the directory is ours).
            let _ = std::fs::remove_dir_all(&p);
            b.create(&p).map_err(io_err(&p))?;
        }
        Ok(Self(p))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds a Unix socket at `path` with `access`'s mode and group, reachable only once both
/// are set.
pub fn bind(path: &Path, access: &Access) -> Result<(UnixListener, IpcPath), IpcError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("/"));
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(io_err(dir))?;
    }
    check_dir(dir)?;
    clear_stale(path)?;
    let staging = Staging::new(dir)?;
    let tmp = staging.0.join("s");
    let listener = UnixListener::bind(&tmp).map_err(io_err(&tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(access.ipc_mode))
        .map_err(io_err(&tmp))?;
    if let Some(gid) = access.ipc_group {
        std::os::unix::fs::chown(&tmp, None, Some(gid)).map_err(|source| IpcError::Group {
            path: path.to_owned(),
            gid,
            source,
        })?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    drop(staging);
    let md = std::fs::symlink_metadata(path).map_err(io_err(path))?;
    Ok((
        listener,
        IpcPath {
            path: path.to_owned(),
            id: (md.dev(), md.ino()),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("kvnode-events-ipc-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::DirBuilder::new().mode(0o755).create(&d).unwrap();
        d
    }

    #[test]
    fn the_socket_appears_with_its_mode_and_goes_with_its_guard() {
        let d = private_dir("mode");
        let p = d.join("ev.sock");
        let access = Access {
            ipc_mode: 0o660,
            ..Access::default()
        };
        let (l, guard) = bind(&p, &access).unwrap();
        let md = std::fs::symlink_metadata(&p).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o660);
        assert!(UnixStream::connect(&p).is_ok());
        // Only the socket is left in the directory: the staging directory is gone.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        // Binding again while served is refused; after the guard, the path is free.
        assert!(matches!(bind(&p, &access), Err(IpcError::InUse(_))));
        drop((l, guard));
        assert!(!p.exists());
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn shared_directories_and_foreign_files_are_refused() {
        let d = private_dir("shared");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = bind(&d.join("ev.sock"), &Access::default()).unwrap_err();
        assert!(matches!(e, IpcError::SharedDir { .. }), "{e}");
        assert!(e.to_string().contains("0777"), "{e}");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(d.join("file"), b"x").unwrap();
        let e = bind(&d.join("file"), &Access::default()).unwrap_err();
        assert!(matches!(e, IpcError::NotASocket(_)), "{e}");
        // A stale socket (nobody serving) is replaced.
        drop(UnixListener::bind(d.join("stale")).unwrap());
        let (_l, _g) = bind(&d.join("stale"), &Access::default()).unwrap();
        let _ = std::fs::remove_dir_all(d);
    }
}
