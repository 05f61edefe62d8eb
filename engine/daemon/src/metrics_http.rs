//! `--metrics HOST:PORT`: a minimal HTTP/1.1 responder serving Prometheus text at `/metrics`.
//!
//! One request per connection (`Connection: close`), GET only, 8 KiB request limit, 5 s
//! read timeout: enough for a scraper, with no HTTP stack to pull in.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvnode_engine::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

async fn answer(engine: &Engine, mut s: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    let mut n = 0;
    while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
        if n == buf.len() {
            break;
        }
        let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf[n..])).await;
        match r {
            Ok(Ok(0)) | Err(_) => return Ok(()),
            Ok(Ok(k)) => n += k,
            Ok(Err(e)) => return Err(e),
        }
    }
    let line = String::from_utf8_lossy(&buf[..n]);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            engine.prometheus(),
        ),
        ("GET", "/") => (
            "200 OK",
            "text/plain",
            "kvnode: metrics at /metrics\n".into(),
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "not found: try /metrics\n".into(),
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    s.shutdown().await
}

/// Binds `addr` and serves until `stop`.
pub async fn spawn(
    engine: Arc<Engine>,
    addr: &str,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics listener on {addr} (--metrics)"))?;
    tracing::info!(addr = %l.local_addr()?, "serving Prometheus metrics at /metrics");
    tokio::spawn(async move {
        loop {
            tokio::select! {
                a = l.accept() => match a {
                    Ok((s, _)) => {
                        let e = Arc::clone(&engine);
                        tokio::spawn(async move {
                            if let Err(err) = answer(&e, s).await {
                                tracing::debug!(error = %err, "metrics request failed");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = stop.changed() => return,
            }
        }
    });
    Ok(())
}
