//! The takeover socket's directory: the daemon's alone, apart from the client socket's.
//!
//! Whoever can connect to the takeover socket and pass the uid check gets the arena memfd
//! (every tenant's blocks) and makes the daemon exit; whoever can write its directory can
//! bind an impostor there. Engines reach the client socket's directory (a hostPath mounted
//! into their pods), so the takeover socket lives elsewhere (default `<socket dir>-admin`,
//! e.g. `/run/kvnode-admin`) in a directory that is:
//!
//! - a real directory (not a symlink), owned by the daemon's uid;
//! - mode 0700: created so when missing; tightened to 0700 when it holds nothing but the
//!   takeover socket (systemd's `RuntimeDirectory=` makes it 0755); refused when it is open
//!   to group or others and holds anything else (it is then not the daemon's own).
//!
//! The socket in it is 0600 and both ends check `SO_PEERCRED` (crate::takeover): the
//! directory is the first fence, the uid check the second.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why the takeover socket's directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TakeoverDirError {
    /// The configuration names no usable place (see `EngineConfig::takeover_path`).
    #[error("{0}")]
    Config(String),
    /// Creating or reading the directory failed.
    #[error(
        "takeover socket directory {dir}: {err}. Create it (owned by uid {uid}, mode 0700) or set takeover_socket / --takeover-socket"
    )]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The daemon's uid.
        uid: u32,
        /// What failed.
        err: std::io::Error,
    },
    /// A symlink or a file where the directory should be.
    #[error(
        "takeover socket directory {0} is not a directory (a symlink or a file): remove it, or set takeover_socket / --takeover-socket"
    )]
    NotADirectory(PathBuf),
    /// Owned by another uid, who could bind an impostor in it.
    #[error(
        "takeover socket directory {dir} is owned by uid {owner}, not by this daemon's uid {uid}: `chown {uid} {dir}` (and chmod 0700), or set takeover_socket / --takeover-socket"
    )]
    NotOwned {
        /// The directory.
        dir: PathBuf,
        /// Its owner.
        owner: u32,
        /// The daemon's uid.
        uid: u32,
    },
    /// Open to group or others, and not the takeover socket's alone.
    #[error(
        "takeover socket directory {dir} (mode {mode:04o}) is open to group or others and holds {other:?}: the takeover socket needs a directory of its own, mode 0700 (default <socket dir>-admin); set takeover_socket / --takeover-socket"
    )]
    Shared {
        /// The directory.
        dir: PathBuf,
        /// Its mode.
        mode: u32,
        /// An entry that is not the takeover socket.
        other: PathBuf,
    },
}

/// The takeover socket of `cfg`, its directory made ready (created 0700, or checked and
/// tightened as the module says).
pub fn prepare(cfg: &kvnode_engine::EngineConfig) -> Result<PathBuf, TakeoverDirError> {
    let path = cfg.takeover_path().map_err(TakeoverDirError::Config)?;
    let dir = path
        .parent()
        .ok_or_else(|| TakeoverDirError::Config(format!("{} has no directory", path.display())))?;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let io = |err| TakeoverDirError::Io {
        dir: dir.to_owned(),
        uid,
        err,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            tracing::info!(dir = %dir.display(), "created the takeover socket's directory (0700)");
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(e)),
    }
    let md = std::fs::symlink_metadata(dir).map_err(io)?;
    if !md.is_dir() {
        return Err(TakeoverDirError::NotADirectory(dir.to_owned()));
    }
    if md.uid() != uid {
        return Err(TakeoverDirError::NotOwned {
            dir: dir.to_owned(),
            owner: md.uid(),
            uid,
        });
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o077 != 0 {
        if let Some(other) = foreign_entry(dir, &path).map_err(io)? {
            return Err(TakeoverDirError::Shared {
                dir: dir.to_owned(),
                mode,
                other,
            });
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        tracing::info!(dir = %dir.display(), was = format!("{mode:04o}"), "takeover socket directory tightened to 0700");
    }
    Ok(path)
}

/// An entry of `dir` other than `socket`, if any.
fn foreign_entry(dir: &Path, socket: &Path) -> std::io::Result<Option<PathBuf>> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p != socket {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvnode_engine::EngineConfig;

    fn cfg(socket: &Path) -> EngineConfig {
        EngineConfig {
            socket: socket.to_owned(),
            ..EngineConfig::default()
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvnode-tdir-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_default_is_a_sibling_admin_directory_created_0700() {
        let d = scratch("default");
        let p = prepare(&cfg(&d.join("sock/kvnode.sock"))).unwrap();
        assert_eq!(p, d.join("sock-admin/kvnode.sock.takeover"));
        let md = std::fs::metadata(d.join("sock-admin")).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o700);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_open_directory_is_tightened_only_when_it_holds_nothing_else() {
        let d = scratch("open");
        let admin = d.join("sock-admin");
        std::fs::create_dir(&admin).unwrap();
        std::fs::set_permissions(&admin, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare(&cfg(&d.join("sock/kvnode.sock"))).unwrap();
        assert_eq!(std::fs::metadata(&admin).unwrap().mode() & 0o7777, 0o700);
        std::fs::set_permissions(&admin, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(admin.join("other"), b"x").unwrap();
        let e = prepare(&cfg(&d.join("sock/kvnode.sock"))).unwrap_err();
        assert!(matches!(e, TakeoverDirError::Shared { .. }), "{e}");
        assert_eq!(std::fs::metadata(&admin).unwrap().mode() & 0o7777, 0o755);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_symlink_is_refused() {
        let d = scratch("symlink");
        std::fs::create_dir(d.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(d.join("elsewhere"), d.join("sock-admin")).unwrap();
        let e = prepare(&cfg(&d.join("sock/kvnode.sock"))).unwrap_err();
        assert!(matches!(e, TakeoverDirError::NotADirectory(_)), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_client_sockets_directory_is_refused() {
        let c = EngineConfig {
            socket: "/run/kvnode/kvnode.sock".into(),
            takeover_socket: Some("/run/kvnode/kvnode.sock.takeover".into()),
            ..EngineConfig::default()
        };
        let e = c.takeover_path().unwrap_err();
        assert!(e.contains("client socket's directory"), "{e}");
        assert_eq!(
            cfg(Path::new("/run/kvnode/kvnode.sock"))
                .takeover_path()
                .unwrap(),
            PathBuf::from("/run/kvnode-admin/kvnode.sock.takeover")
        );
    }
}
