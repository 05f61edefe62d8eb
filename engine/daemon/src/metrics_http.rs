//! `--metrics HOST:PORT`: Prometheus text at `GET /metrics`, served by hyper's HTTP/1.1 server.
//!
//! - `GET`/`HEAD /metrics`: 200, `text/plain; version=0.0.4; charset=utf-8`, the exporter's
//!   render; `/`: a one-line pointer; any other path 404; any other method 405.
//! - Bounds: request head at most 8 KiB (431 beyond), read within 1 s; one request per
//!   connection (keep-alive off, as a scraper needs nothing more); every connection closed
//!   after 10 s whatever it does; at most 512 connections at once (more wait in the backlog).
//! - Stop: on the daemon's stop signal the listener closes; connections in flight finish their
//!   response (hyper's graceful shutdown) within the same 10 s, and [`spawn`]'s task ends
//!   only then, so the engine the exporter holds is released before the daemon drops it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kvnode_engine::Engine;
use kvnode_engine::obs::prom;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// What a scrape renders: the metrics text, or why it could not be encoded.
type RenderFn = dyn Fn() -> Result<String, std::fmt::Error> + Send + Sync;
type Render = Arc<RenderFn>;

/// Time and size bounds of the listener.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// The request line and headers must arrive within this.
    head_timeout: Duration,
    /// A connection is closed this long after it was accepted (and in-flight connections get
    /// this long to finish after stop).
    conn_timeout: Duration,
    /// Connections served at once.
    max_conns: usize,
}

/// A scrape's head is a few hundred bytes sent at once: 1 s is plenty, and trickling
/// connections give their slot back quickly; 512 connections at once (8 KiB of head
/// buffer each) leave room for scrapes next to hundreds of slow or hostile ones.
const LIMITS: Limits = Limits {
    head_timeout: Duration::from_secs(1),
    conn_timeout: Duration::from_secs(10),
    max_conns: 512,
};

/// Largest request head (request line and headers); hyper's minimum read buffer.
const MAX_HEAD: usize = 8 << 10;

/// Binds `addr` and serves the engine's metrics until `stop`; await the handle after stop.
pub async fn spawn(
    engine: &Arc<Engine>,
    addr: &str,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics listener on {addr} (--metrics)"))?;
    tracing::info!(addr = %l.local_addr()?, "serving Prometheus metrics at /metrics");
    let exporter = engine.exporter();
    let render: Render = Arc::new(move || exporter.render());
    Ok(tokio::spawn(serve(l, render, LIMITS, stop)))
}

/// Accepts until `stop` (or its sender is gone), then lets connections finish.
async fn serve(l: TcpListener, render: Render, limits: Limits, mut stop: watch::Receiver<bool>) {
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
                    conns.spawn(connection(s, Arc::clone(&render), limits, stop.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
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
        tracing::warn!("metrics connections still open at stop; closed");
    }
}

/// Serves one connection: one request, bounded in size and time.
async fn connection(s: TcpStream, render: Render, limits: Limits, mut stop: watch::Receiver<bool>) {
    let svc = service_fn(move |req: Request<Incoming>| {
        let r = route(&req, &*render);
        async move { Ok::<_, Infallible>(r) }
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
        Ok(Err(e)) => tracing::debug!(error = %e, "metrics connection failed"),
        Err(_) => tracing::debug!("metrics connection closed at its time limit"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The response to one request.
fn route(req: &Request<Incoming>, render: &RenderFn) -> Response<Full<Bytes>> {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD only\n");
        r.headers_mut()
            .insert(ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/metrics" => {
            let Ok(body) = render() else {
                tracing::warn!("a metric could not be encoded; scrape answered 500");
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "metrics could not be encoded (see the daemon log)\n",
                );
            };
            let mut r = Response::new(Full::new(Bytes::from(body)));
            r.headers_mut().insert(
                CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(prom::CONTENT_TYPE),
            );
            r
        }
        "/" => text(StatusCode::OK, "kvnode: metrics at /metrics\n"),
        _ => text(StatusCode::NOT_FOUND, "not found: try /metrics\n"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const FAST: Limits = Limits {
        head_timeout: Duration::from_millis(300),
        conn_timeout: Duration::from_secs(2),
        max_conns: 4,
    };

    async fn start() -> (u16, watch::Sender<bool>, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = watch::channel(false);
        let render: Render = Arc::new(|| Ok("kvnode_up 1\n".to_owned()));
        (port, tx, tokio::spawn(serve(l, render, FAST, rx)))
    }

    /// Sends `req` and reads until the server closes (every response closes: keep-alive off).
    async fn exchange(port: u16, req: &[u8]) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(req).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .expect("the server closes the connection after one response")
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[tokio::test]
    async fn metrics_has_its_content_type_other_paths_404_other_methods_405() {
        let (port, stop, task) = start().await;
        let r = exchange(port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(
            r.contains("content-type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            "{r}"
        );
        assert!(r.contains("connection: close\r\n"), "{r}");
        assert!(r.ends_with("\r\n\r\nkvnode_up 1\n"), "{r}");
        let r = exchange(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(
            r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\n"),
            "{r}"
        );
        let r = exchange(port, b"GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 404 Not Found\r\n"), "{r}");
        let r = exchange(
            port,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{r}");
        assert!(r.contains("allow: GET, HEAD\r\n"), "{r}");
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn oversized_head_gets_431_and_a_silent_client_is_dropped() {
        let (port, _stop, _task) = start().await;
        let big = format!(
            "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
            "a".repeat(MAX_HEAD)
        );
        let r = exchange(port, big.as_bytes()).await;
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
        let t = Instant::now();
        let r = exchange(port, b"GET /metrics HTTP/1.1\r\n").await;
        assert!(!r.contains("200 OK"), "{r}");
        assert!(
            t.elapsed() < FAST.head_timeout + Duration::from_secs(1),
            "an incomplete head was held {:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn stop_closes_the_listener_and_ends_the_task_with_a_client_mid_request() {
        let (port, stop, task) = start().await;
        let mut slow = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        slow.write_all(b"GET /metr").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert!(
            t.elapsed() < FAST.conn_timeout,
            "stop took {:?}",
            t.elapsed()
        );
        assert!(TcpStream::connect(("127.0.0.1", port)).await.is_err());
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest).await;
    }
}
