//! The router's view: a ZMQ subscriber per daemon feeding the shared [`Index`] from the KV
//! events kvnode publishes (Dynamo's msgpack layout, docs/events.md). Events arrive when the
//! publisher sends them, so the router's view lags the daemons as a real router's does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use zeromq::{Socket, SocketRecv, SubSocket};

use super::router::Index;

/// The index and what the subscribers have seen.
#[derive(Debug, Default)]
pub struct View {
    /// Which cache holds which block, as heard.
    pub index: Mutex<Index>,
    /// Events received per cache.
    pub seen: Vec<AtomicU64>,
    /// Subscribers connected.
    pub connected: AtomicU64,
    stop: AtomicBool,
}

/// The subscribers' thread; stops and joins on drop.
#[derive(Debug)]
pub struct Subscribers {
    /// Shared view.
    pub view: Arc<View>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl Drop for Subscribers {
    fn drop(&mut self) {
        self.view.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One decoded event: its tag and block hashes.
fn apply(view: &View, cache: usize, ev: &serde_json::Value) {
    let tag = ev.get(0).and_then(|t| t.as_str()).unwrap_or("");
    let hashes = ev.get(1).and_then(|h| h.as_array());
    let mut ix = view.index.lock().expect("index lock");
    match (tag, hashes) {
        ("BlockStored", Some(h)) => h
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .for_each(|b| ix.stored(cache, b)),
        ("BlockRemoved", Some(h)) => h
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .for_each(|b| ix.removed(cache, b)),
        ("AllBlocksCleared", _) => ix.cleared(cache),
        _ => {}
    }
    view.seen[cache].fetch_add(1, Ordering::Relaxed);
}

async fn subscribe(view: Arc<View>, cache: usize, endpoint: String) -> anyhow::Result<()> {
    let mut sub = SubSocket::new();
    sub.connect(&endpoint)
        .await
        .with_context(|| format!("subscribing to {endpoint}"))?;
    sub.subscribe("").await?;
    view.connected.fetch_add(1, Ordering::Relaxed);
    loop {
        let msg = match tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            Ok(m) => m?,
            Err(_) if view.stop.load(Ordering::Relaxed) => return Ok(()),
            Err(_) => continue,
        };
        ensure!(msg.len() == 3, "a KV event message of {} frames", msg.len());
        let (_ts, events, _rank): (f64, Vec<serde_json::Value>, Option<i64>) =
            rmp_serde::from_slice(msg.get(2).context("payload frame")?)?;
        for ev in &events {
            apply(&view, cache, ev);
        }
    }
}

/// Subscribes to every endpoint (cache `i` = `endpoints[i]`) and waits until all are
/// connected.
pub fn start(endpoints: &[String]) -> anyhow::Result<Subscribers> {
    let view = Arc::new(View {
        seen: endpoints.iter().map(|_| AtomicU64::new(0)).collect(),
        ..View::default()
    });
    let eps = endpoints.to_vec();
    let v = Arc::clone(&view);
    let thread = std::thread::spawn(move || -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let tasks: Vec<_> = eps
                .into_iter()
                .enumerate()
                .map(|(i, ep)| tokio::spawn(subscribe(Arc::clone(&v), i, ep)))
                .collect();
            for t in tasks {
                t.await??;
            }
            Ok(())
        })
    });
    let t = Instant::now();
    while view.connected.load(Ordering::Relaxed) < endpoints.len() as u64 {
        ensure!(
            t.elapsed() < Duration::from_secs(10),
            "KV event subscribers did not connect"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A SUB's subscription reaches the publisher after its connect: give it time, or the
    // first events are lost (ZMQ's slow joiner).
    std::thread::sleep(Duration::from_millis(300));
    Ok(Subscribers {
        view,
        thread: Some(thread),
    })
}
