//! Listener: binds the socket (refusing to steal a live daemon's), accepts, drains on stop.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::conn::Connection;
use crate::engine::Engine;

/// Failure to bind or serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Another daemon answers on the socket.
    #[error("another kvnode daemon is already listening on {0}; stop it or pass --socket")]
    InUse(PathBuf),
    /// I/O on the socket path.
    #[error("cannot bind {path}: {err}")]
    Bind {
        /// Path.
        path: PathBuf,
        /// Cause.
        err: std::io::Error,
    },
}

/// Binds the Unix socket, creating its directory and removing a stale socket file.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    let err = |err| ServeError::Bind {
        path: path.to_owned(),
        err,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::InUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let l = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    Ok(l)
}

/// Serves until `stop` turns true, then stops accepting and gives connections up to the
/// drain timeout to finish their current request.
pub async fn serve(engine: Arc<Engine>, listener: UnixListener, mut stop: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let c = Connection::new(Arc::clone(&engine), stream, stop.clone());
                    conns.spawn(c.run());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
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
