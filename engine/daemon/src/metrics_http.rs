//! `--metrics HOST:PORT`: Prometheus text at `GET /metrics`, served by hyper's HTTP/1.1 server.
//!
//! - `GET`/`HEAD /metrics`: 200, `text/plain; version=0.0.4; charset=utf-8`, the exporter's
//!   render; `/`: a one-line pointer; any other path 404; any other method 405.
//! - Bounds and stop: [`http::LIMITS`] (crate::http): head at most 8 KiB read within 1 s, one
//!   request per connection (a scraper needs nothing more), 10 s per connection, 512 at once;
//!   [`spawn`]'s task ends only after the connections in flight, so the engine the exporter
//!   holds is released before the daemon drops it.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use kvnode_engine::Engine;
use kvnode_engine::obs::prom;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::http::{self, Reply, text};

/// What a scrape renders: the metrics text, or why it could not be encoded.
type RenderFn = dyn Fn() -> Result<String, std::fmt::Error> + Send + Sync;
type Render = Arc<RenderFn>;

/// Binds `addr` and serves the engine's metrics until `stop`; await the handle after stop.
pub async fn spawn(
    engine: &Arc<Engine>,
    addr: &str,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    let exporter = engine.exporter();
    let render: Render = Arc::new(move || exporter.render());
    let handler = move |req: Request<Incoming>| {
        let r = route(&req, &*render);
        async move { r }
    };
    let what = http::Named {
        name: "metrics",
        serves: "Prometheus metrics at /metrics",
        flag: "--metrics",
    };
    http::spawn(what, addr, handler, http::LIMITS, stop).await
}

/// The response to one request.
fn route(req: &Request<Incoming>, render: &RenderFn) -> Reply {
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
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::http::MAX_HEAD;

    use super::*;

    const FAST: http::Limits = http::Limits {
        head_timeout: Duration::from_millis(300),
        conn_timeout: Duration::from_secs(2),
        max_conns: 4,
    };

    async fn start() -> (u16, watch::Sender<bool>, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = watch::channel(false);
        let render: Render = Arc::new(|| Ok("kvnode_up 1\n".to_owned()));
        let handler = move |req: Request<Incoming>| {
            let r = route(&req, &*render);
            async move { r }
        };
        (
            port,
            tx,
            tokio::spawn(http::serve("metrics", l, handler, FAST, rx)),
        )
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
