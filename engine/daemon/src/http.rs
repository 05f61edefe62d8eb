//! The daemon's small HTTP/1.1 listeners (`/metrics`, the router entry), on hyper's server:
//! one request per connection, bounded in head size and time, a bound on connections at
//! once, and a graceful stop. Each listener gives the handler that answers its requests.
//!
//! - Bounds: request head within `head_timeout` and at most 8 KiB (431 beyond); keep-alive
//!   off; every connection closed `conn_timeout` after it was accepted whatever it does; at
//!   most `max_conns` connections at once (more wait in the backlog).
//! - Stop: on the daemon's stop signal the listener closes; connections in flight finish their
//!   response (hyper's graceful shutdown) within the same `conn_timeout`, and [`serve`] ends
//!   only then, so whatever the handler holds is released before the daemon drops it.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A response with its whole body.
pub type Reply = Response<Full<Bytes>>;

/// Time and size bounds of the listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The request line and headers must arrive within this.
    pub head_timeout: Duration,
    /// A connection is closed this long after it was accepted (and in-flight connections get
    /// this long to finish after stop).
    pub conn_timeout: Duration,
    /// Connections served at once.
    pub max_conns: usize,
}

/// A scrape's head is a few hundred bytes sent at once: 1 s is plenty, and trickling
/// connections give their slot back quickly; 512 connections at once (8 KiB of head
/// buffer each) leave room for scrapes next to hundreds of slow or hostile ones.
pub const LIMITS: Limits = Limits {
    head_timeout: Duration::from_secs(1),
    conn_timeout: Duration::from_secs(10),
    max_conns: 512,
};

/// Largest request head (request line and headers); hyper's minimum read buffer.
pub const MAX_HEAD: usize = 8 << 10;

/// Accepts until `stop` (or its sender is gone), then lets connections finish.
pub async fn serve<H, F>(
    name: &'static str,
    l: TcpListener,
    handler: H,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let mut conns = JoinSet::new();
    while !*stop.borrow_and_update() {
        while conns.try_join_next().is_some() {}
        if conns.len() >= limits.max_conns {
            tokio::select! {
                _ = conns.join_next() => continue,
                _ = stop.changed() => break,
            }
        }
        tokio::select! {
            a = l.accept() => match a {
                Ok((s, _)) => {
                    conns.spawn(connection(name, s, handler.clone(), limits, stop.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, listener = name, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => break,
        }
    }
    drop(l);
    // Each connection saw the stop too and is finishing within its own bound; this one only
    // guards against a bug there. Dropping the set aborts what is left.
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.conn_timeout, drain)
        .await
        .is_err()
    {
        tracing::warn!(listener = name, "connections still open at stop; closed");
    }
}

/// Serves one connection: one request, bounded in size and time.
async fn connection<H, F>(
    name: &'static str,
    s: TcpStream,
    handler: H,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let svc = service_fn(move |req: Request<Incoming>| {
        let r = handler(req);
        async move { Ok::<_, Infallible>(r.await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.head_timeout)
        .max_buf_size(MAX_HEAD)
        .max_header_size(MAX_HEAD)
        .keep_alive(false)
        .serve_connection(TokioIo::new(s), svc);
    let mut conn = std::pin::pin!(conn);
    let run = async {
        tokio::select! {
            r = conn.as_mut() => return r,
            _ = stop.changed() => {}
        }
        // Finish the response in progress, if any, then close.
        conn.as_mut().graceful_shutdown();
        conn.await
    };
    match tokio::time::timeout(limits.conn_timeout, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, listener = name, "connection failed"),
        Err(_) => tracing::debug!(listener = name, "connection closed at its time limit"),
    }
}

/// What a listener is, for its bind error and start-up line.
#[derive(Debug, Clone, Copy)]
pub struct Named {
    /// Short name (logs).
    pub name: &'static str,
    /// What it serves, for the start-up line.
    pub serves: &'static str,
    /// The flag that asked for it, for the bind error.
    pub flag: &'static str,
}

/// Binds `addr` and serves `handler` on it until `stop`; await the handle after stop.
pub async fn spawn<H, F>(
    what: Named,
    addr: &str,
    handler: H,
    limits: Limits,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>>
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    use anyhow::Context as _;
    let l = TcpListener::bind(addr).await.with_context(|| {
        format!(
            "binding the {} listener on {addr} ({})",
            what.name, what.flag
        )
    })?;
    tracing::info!(addr = %l.local_addr()?, "serving {}", what.serves);
    Ok(tokio::spawn(serve(what.name, l, handler, limits, stop)))
}

/// A plain-text response.
pub fn text(status: StatusCode, body: &'static str) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
