//! A request cut by a takeover is sent again on a new connection, so the caller never sees
//! the cut (docs/operations.md "Takeover").
//!
//! At a takeover's barrier the old daemon finishes the request in flight on each connection,
//! answers it, and closes the connection; the next request on it finds it closed (end of
//! file, broken pipe, reset) before any answer, or is refused as `ShuttingDown` when it
//! arrived during the drain. The successor listens on the same socket with
//! the same arena memfd and namespace handles. So a request that names no state of the old
//! connection ([`replayable`]: register, exists, stats, an inline put or get) is sent once
//! more on a new connection, after the connection's namespaces are registered again there.
//! The new connection is used only when it is provably the same tier: the same arena file
//! and the same handle for every namespace; otherwise the caller gets the original error, as
//! before. Reservation handles, leases and attached regions belong to the old connection:
//! requests that use them are never replayed.

use std::os::unix::fs::MetadataExt;

use kvnode_proto::NamespaceSpec;
use kvnode_proto::client::{ErrorCode, GetMode, Op, Reply};

use crate::{Client, ClientError, Result, conn, unexpected};

/// How long a reconnection waits for the daemon's handshake: a successor answers once the
/// old daemon has exited and it has opened the spill files (milliseconds without a spill
/// tier); after a plain stop the old daemon's backlog is reset when it exits, within its
/// stop-time flush (`flush_on_stop_s`, 60 s by default), or this limit ends the wait first.
const HANDSHAKE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether `op` may be sent again on a new connection: it names no state of the old one,
/// and doing it twice is harmless (a put done twice answers `Exists` the second time).
pub(crate) fn replayable(op: &Op) -> bool {
    matches!(
        op,
        Op::Register { .. }
            | Op::Exists { .. }
            | Op::Stats
            | Op::Put { .. }
            | Op::Get {
                mode: GetMode::Inline,
                ..
            }
    )
}

/// Whether `e` says the daemon closed the connection, or refused the request because it is
/// stopping (a request that arrived during a takeover's drain): in both cases it did not do
/// the request. After a plain stop the reconnection fails (waiting until the old daemon has
/// exited and its backlog is reset, at most [`HANDSHAKE_LIMIT`]) and the caller gets `e`.
pub(crate) fn closed(e: &ClientError) -> bool {
    use std::io::ErrorKind as K;
    match e {
        ClientError::Io(io) => matches!(
            io.kind(),
            K::UnexpectedEof | K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted
        ),
        ClientError::Server { code, .. } => *code == ErrorCode::ShuttingDown,
        _ => false,
    }
}

/// A `ShuttingDown` refusal as an error (so that [`Client::retrying`] sees it); any other
/// reply as it is.
pub(crate) fn refused(r: Reply) -> Result<Reply> {
    match r {
        Reply::Error {
            code: ErrorCode::ShuttingDown,
            message,
        } => Err(ClientError::Server {
            code: ErrorCode::ShuttingDown,
            message,
        }),
        r => Ok(r),
    }
}

/// (device, inode) of a descriptor's file.
pub(crate) fn file_id(fd: &std::os::fd::OwnedFd) -> Option<(u64, u64)> {
    let f = std::fs::File::from(fd.try_clone().ok()?);
    let m = f.metadata().ok()?;
    Some((m.dev(), m.ino()))
}

impl Client {
    /// Runs `f` on the connection; when the daemon closed it before answering a
    /// [`replayable`] request, reconnects and runs `f` once more.
    ///
    /// Again while the answer is a refusal of a stopping daemon, until [`HANDSHAKE_LIMIT`]: a
    /// connection made during the old daemon's drain can still be accepted by it (its accept
    /// loop stops an instant after it starts refusing requests), and the request sent on it
    /// is refused once more; the next connection reaches the successor.
    pub(crate) fn retrying<T>(
        &mut self,
        op: &Op,
        mut f: impl FnMut(&mut conn::Conn) -> Result<T>,
    ) -> Result<T> {
        let deadline = std::time::Instant::now() + HANDSHAKE_LIMIT;
        let mut r = f(&mut self.conn);
        let mut tries = 0u32;
        loop {
            match r {
                Err(e) if closed(&e) && replayable(op) && std::time::Instant::now() < deadline => {
                    if tries > 0 {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                    tries += 1;
                    if self.reconnect().is_err() {
                        return Err(e);
                    }
                    r = f(&mut self.conn);
                }
                r => return r,
            }
        }
    }

    /// Remembers a namespace this connection registered (replayed on a new connection).
    pub(crate) fn registered(&mut self, spec: &NamespaceSpec, ns: u32) {
        if !self.namespaces.iter().any(|(s, _)| s == spec) {
            self.namespaces.push((spec.clone(), ns));
        }
    }

    /// A new connection to the same socket, used only when it serves the same arena and the
    /// same namespace handles.
    fn reconnect(&mut self) -> Result<()> {
        let (mut c, hello, fd) =
            conn::Conn::connect_within(&self.path, "kvnode-client", Some(HANDSHAKE_LIMIT))?;
        let Reply::HelloOk { pid, .. } = hello else {
            return Err(unexpected(&hello));
        };
        let same_arena = match (&fd, &self.arena_id) {
            (Some(fd), Some(id)) => file_id(fd).as_ref() == Some(id),
            (None, None) => true,
            _ => false,
        };
        if !same_arena {
            return Err(ClientError::Protocol(
                "the daemon on this socket serves another arena".into(),
            ));
        }
        for (spec, ns) in &self.namespaces {
            match c.call(Op::Register { spec: spec.clone() }, &[])? {
                Reply::Registered { ns: got, .. } if got == *ns => {}
                r => {
                    return Err(ClientError::Protocol(format!(
                        "namespace {} is not the same on the daemon now: {r:?}",
                        spec.model
                    )));
                }
            }
        }
        self.conn = c;
        self.pid = pid;
        Ok(())
    }
}
