//! Listener: binds the socket (refusing to steal a live daemon's), accepts, drains on stop.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::conn::Connection;
use super::gate::{Gate, screen};
use crate::engine::Engine;

/// Failure to bind or serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Another daemon answers on the socket.
    #[error("another kvnode daemon is already listening on {0}; stop it or pass --socket")]
    InUse(PathBuf),
    /// Something that is not a socket sits at the socket path.
    #[error(
        "{0} exists and is not a socket: refusing to replace it; remove it or pass another --socket"
    )]
    NotASocket(PathBuf),
    /// Other users may write the socket's directory.
    #[error(
        "{dir} (mode {mode:04o}) may be written by other users, who could replace the socket or answer on its takeover socket: use a private directory (e.g. $XDG_RUNTIME_DIR or /run/kvnode), or pass --allow-shared-socket-dir"
    )]
    SharedDir {
        /// The directory.
        dir: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// I/O on the socket path.
    #[error("cannot bind {path}: {err}")]
    Bind {
        /// Path.
        path: PathBuf,
        /// Cause.
        err: std::io::Error,
    },
}

/// Refuses a socket directory that group or others may write (unless `allow`): there,
/// another user could replace the socket, or bind `<socket>.takeover` before this daemon.
pub fn check_socket_dir(path: &Path, allow: bool) -> Result<(), ServeError> {
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    let Ok(md) = std::fs::metadata(dir) else {
        return Ok(());
    };
    let mode = md.permissions().mode() & 0o7777;
    if mode & 0o022 == 0 {
        return Ok(());
    }
    if allow {
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:04o}"), "the socket directory may be written by other users (--allow-shared-socket-dir)");
        return Ok(());
    }
    Err(ServeError::SharedDir {
        dir: dir.to_owned(),
        mode,
    })
}

/// Binds the Unix socket, creating its directory (0755 at most) and replacing only a
/// stale socket (never a regular file or anything else that happens to sit at the path).
/// A directory others may write is refused first ([`check_socket_dir`]) unless `allow`.
pub fn bind(path: &Path, mode: u32, allow_shared_dir: bool) -> Result<UnixListener, ServeError> {
    let err = |err| ServeError::Bind {
        path: path.to_owned(),
        err,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    check_socket_dir(path, allow_shared_dir)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) {
            return Err(ServeError::NotASocket(path.to_owned()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::InUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let l = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    Ok(l)
}

/// Raises the soft descriptor limit to the hard one (every client connection, region and
/// spill file costs descriptors); returns the (soft, hard) limits now in force.
pub fn raise_fd_limit() -> std::io::Result<(u64, u64)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut r) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const r) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((r.rlim_cur, r.rlim_max))
}

/// Serves until `stop` turns true, then stops accepting and gives connections up to the
/// drain timeout to finish their current request.
pub async fn serve(engine: Arc<Engine>, listener: UnixListener, mut stop: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    let mut failures = 0u32;
    let gate = Gate::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    failures = 0u32;
                    match screen(&engine, &gate, stream) {
                        Ok(a) => {
                            let c = Connection::new(Arc::clone(&engine), a, stop.clone());
                            conns.spawn(c.run());
                        }
                        Err(refused) => {
                            conns.spawn(refused.answer());
                        }
                    }
                }
                Err(e) => {
                    // Out of descriptors (EMFILE/ENFILE) or memory: back off, exponentially
                    // up to a second, and say so once per episode.
                    failures += 1;
                    engine.metrics.accept_failed();
                    if failures == 1 {
                        tracing::warn!(error = %e, "accept failed; backing off (see kvnode_accept_failures_total)");
                    }
                    let pause = Duration::from_millis(10 << failures.min(7)).min(Duration::from_secs(1));
                    tokio::time::sleep(pause).await;
                }
            },
            _ = stop.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    let n = conns.len();
    if n > 0 {
        tracing::info!(connections = n, "draining connections");
    }
    let drain = Duration::from_secs_f64(engine.config.drain_timeout_s);
    let deadline = tokio::time::sleep(drain);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            next = conns.join_next() => if next.is_none() { break },
            () = &mut deadline => {
                tracing::warn!(connections = conns.len(), "drain timeout; closing remaining connections");
                conns.shutdown().await;
                break;
            }
        }
    }
}
