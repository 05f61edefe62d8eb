//! `Publisher`: owns the PUB and replay sockets on its own thread and turns queued events into batches.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use zeromq::{PubSocket, RouterSocket, Socket, SocketSend, ZmqMessage};

use crate::account::{QueueCharge, ring_shares};
use crate::batch::EventBatch;
use crate::config::{Access, PublisherConfig};
use crate::endpoint::Endpoint;
use crate::error::PublisherError;
use crate::ipc::{self, IpcPath};
use crate::replay::{self, Ring, SharedRing};
use crate::sink::{EventSink, Item, Queued};
use crate::snapshot::{Marker, SourceSlot};
use crate::stats::{Counters, Stats, bump, kind_index};
use crate::validate::ValidEvent;
use crate::wire::now_ts;

/// Publishes KV event batches on a bound ZMQ PUB socket, with an optional replay socket.
///
/// `start` spawns one thread (`kvnode-events`) running a single-threaded tokio runtime that
/// owns both sockets, so callers need no runtime of their own and the engine's runtime never
/// runs socket work. Events arrive through [`EventSink`]s; batches leave as
/// `[topic "", seq (8-byte BE), msgpack batch]`. Dropping the publisher (or calling
/// [`Publisher::shutdown`]) publishes what is queued, lingers, and joins the thread.
#[derive(Debug)]
pub struct Publisher {
    sink: EventSink,
    counters: Arc<Counters>,
    endpoint: String,
    replay_endpoint: Option<String>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
    /// Told once the queue is published and both endpoints are unbound (before the linger).
    released: std::sync::mpsc::Receiver<()>,
}

/// Endpoints as bound (port 0 resolved), reported by the thread once its sockets are up.
struct Bound {
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl Publisher {
    /// Validates `config`, binds the sockets and starts the publisher thread. Returns once
    /// both sockets are bound, or with the bind error.
    pub fn start(config: PublisherConfig) -> Result<Self, PublisherError> {
        let (endpoint, replay) = config.validate()?;
        let counters = Arc::new(Counters::default());
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let queue_bytes = config.queue_bytes;
        let (stop_tx, stop_rx) = watch::channel(false);
        let source = Arc::new(SourceSlot::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (released_tx, released) = std::sync::mpsc::sync_channel(1);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(PublisherError::Start)?;
        let thread_counters = Arc::clone(&counters);
        let thread_source = Arc::clone(&source);
        let thread = std::thread::Builder::new()
            .name("kvnode-events".into())
            .spawn(move || {
                let chan = Channel {
                    rx,
                    source: thread_source,
                    counters: thread_counters,
                    stop: stop_rx,
                    ready: ready_tx,
                    released: released_tx,
                };
                runtime.block_on(run(config, endpoint, replay, chan));
            })
            .map_err(PublisherError::Start)?;
        let bound = match ready_rx.recv() {
            Ok(Ok(bound)) => bound,
            Ok(Err(error)) => {
                let _ = thread.join();
                return Err(error);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(PublisherError::StartupAborted);
            }
        };
        tracing::info!(
            endpoint = %bound.endpoint,
            replay = ?bound.replay_endpoint,
            "KV event publisher bound"
        );
        Ok(Self {
            sink: EventSink::new(tx, Arc::clone(&counters), queue_bytes, source),
            counters,
            endpoint: bound.endpoint,
            replay_endpoint: bound.replay_endpoint,
            stop: Some(stop_tx),
            thread: Some(thread),
            released,
        })
    }

    /// Stops taking events, publishes what is queued and unbinds both endpoints, then
    /// returns (at most `limit`) while the thread lingers for the subscribers already
    /// connected; dropping the publisher later joins it. A takeover's old daemon calls this
    /// before it lets its successor go, which binds the same endpoints: the linger then
    /// overlaps the successor's start instead of delaying it.
    pub fn release(&mut self, limit: std::time::Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if self.released.recv_timeout(limit).is_err() {
            tracing::warn!(?limit, "the KV event publisher did not unbind in time");
        }
    }

    /// A handle to submit events; clone it freely.
    pub fn sink(&self) -> EventSink {
        self.sink.clone()
    }

    /// The PUB endpoint as bound (a configured port 0 shows the real port).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    /// Publishes every queued event, keeps the sockets open for the configured linger,
    /// closes them and returns the final counters. Later sink calls fail with `Closed`.
    pub fn shutdown(mut self) -> Stats {
        self.stop_and_join();
        self.counters.snapshot()
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("KV event publisher thread panicked; queued events are lost");
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

type Ready = std::sync::mpsc::SyncSender<Result<Bound, PublisherError>>;

/// What the publisher thread is handed besides its config.
struct Channel {
    rx: mpsc::Receiver<Item>,
    /// The residency source snapshots come from, once the engine registers one.
    source: Arc<SourceSlot>,
    counters: Arc<Counters>,
    stop: watch::Receiver<bool>,
    ready: Ready,
    released: std::sync::mpsc::SyncSender<()>,
}

/// Binds `socket` at `endpoint`: a tcp address as is, an ipc path through
/// [`ipc::bind`] (mode and group set before anyone can connect). Returns the endpoint as
/// bound and, for ipc, the guard that removes the socket file.
async fn bind<S: Socket>(
    socket: &mut S,
    name: &'static str,
    endpoint: &Endpoint,
    access: &Access,
) -> Result<(String, Option<IpcPath>), PublisherError> {
    let zmq = |source| PublisherError::Bind {
        socket: name,
        endpoint: endpoint.to_string(),
        source,
    };
    match endpoint {
        Endpoint::Tcp { .. } => {
            let bound = socket.bind(&endpoint.to_string()).await.map_err(zmq)?;
            Ok((bound.to_string(), None))
        }
        Endpoint::Ipc(path) => {
            let (listener, guard) =
                ipc::bind(path, access).map_err(|source| PublisherError::Ipc {
                    socket: name,
                    source,
                })?;
            socket.bind_listener(listener).await.map_err(zmq)?;
            Ok((endpoint.to_string(), Some(guard)))
        }
    }
}

/// The publisher thread's body: bind, report, batch until stopped, drain, linger.
async fn run(config: PublisherConfig, endpoint: Endpoint, replay: Option<Endpoint>, chan: Channel) {
    let Channel {
        mut rx,
        source,
        counters,
        mut stop,
        ready,
        released,
    } = chan;
    let mut socket = PubSocket::new();
    let (endpoint, pub_path) = match bind(&mut socket, "PUB", &endpoint, &config.access).await {
        Ok(bound) => bound,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let (replay_stop_tx, replay_stop_rx) = watch::channel(false);
    let mut replay_task = None;
    let mut replay_endpoint = None;
    let mut replay_path = None;
    // No replay endpoint, no ring: nothing is kept after a batch is sent.
    let mut ring = None;
    if let Some(replay_ep) = &replay {
        let mut router = RouterSocket::new();
        match bind(&mut router, "replay ROUTER", replay_ep, &config.access).await {
            Ok((ep, path)) => {
                replay_endpoint = Some(ep);
                replay_path = path;
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        }
        let r: SharedRing = Arc::new(Mutex::new(Ring::starting_at(
            config.first_seq,
            config.replay_ring_len,
            config.replay_ring_bytes,
            Arc::clone(&counters),
        )));
        let answer = replay::Answerer {
            ring: Arc::clone(&r),
            source,
            counters: Arc::clone(&counters),
            dp_rank: config.dp_rank,
            batch_events: config.max_batch_events,
            pace: Mutex::default(),
        };
        let serve = replay::serve(router, answer, replay_stop_rx);
        replay_task = Some(tokio::spawn(serve));
        ring = Some(r);
    }
    let _ = ready.send(Ok(Bound {
        endpoint,
        replay_endpoint,
    }));

    let mut batcher = Batcher {
        socket,
        ring,
        counters,
        dp_rank: config.dp_rank,
        buf: Vec::with_capacity(config.max_batch_events),
        charges: Vec::with_capacity(config.max_batch_events),
        max_events: config.max_batch_events,
        seq: config.first_seq,
    };
    batcher.run(&mut rx, &mut stop, config.flush_interval).await;
    // Nothing new is accepted from here; what is already queued still goes out.
    rx.close();
    while let Some(item) = rx.recv().await {
        if batcher.take(item).await || batcher.buf.len() == batcher.max_events {
            batcher.publish().await;
        }
    }
    batcher.publish().await;
    // Free both endpoints (a takeover's successor binds them next), then linger: peers
    // already connected keep receiving what was sent. A replay asked for after this goes to
    // whoever binds the endpoint next.
    let _ = replay_stop_tx.send(true);
    if let Some(task) = replay_task {
        let _ = task.await;
    }
    let _ = batcher.socket.unbind_all().await;
    drop(replay_path);
    drop(pub_path);
    let _ = released.send(());
    tokio::time::sleep(config.linger).await;
}

/// Collects events into batches and publishes them with consecutive sequence numbers.
struct Batcher {
    socket: PubSocket,
    /// `None` without a replay endpoint.
    ring: Option<SharedRing>,
    counters: Arc<Counters>,
    dp_rank: Option<u32>,
    buf: Vec<ValidEvent>,
    /// The queue charges of `buf`'s events, given back once their batch is sent.
    charges: Vec<QueueCharge>,
    max_events: usize,
    seq: u64,
}

impl Batcher {
    /// Buffers an event; a marker seals the open batch and learns the seq after it.
    /// Returns whether the batch was sealed.
    async fn take(&mut self, item: Item) -> bool {
        match item {
            Item::Event(Queued { event, charge }) => {
                self.buf.push(event);
                self.charges.push(charge);
                false
            }
            Item::Mark(marker) => {
                self.seal(marker).await;
                true
            }
        }
    }

    /// Publishes the open batch, then tells `marker` the seq of the next batch: every
    /// event queued before the marker is in a batch below it, every later one at or above.
    async fn seal(&mut self, marker: Marker) {
        self.publish().await;
        marker.resolve(self.seq);
    }

    /// Seals a batch when it holds `max_events`, or `interval` after its first event
    /// arrived, whichever is first. Returns when `stop` flips or every sink is gone.
    async fn run(
        &mut self,
        rx: &mut mpsc::Receiver<Item>,
        stop: &mut watch::Receiver<bool>,
        interval: std::time::Duration,
    ) {
        let mut stopping = false;
        while !stopping {
            let first = tokio::select! {
                biased;
                _ = stop.changed() => break,
                first = rx.recv() => first,
            };
            let Some(first) = first else { break };
            if self.take(first).await {
                continue;
            }
            let deadline = tokio::time::sleep_until(Instant::now() + interval);
            tokio::pin!(deadline);
            while self.buf.len() < self.max_events {
                match rx.try_recv() {
                    Ok(item) => {
                        if self.take(item).await {
                            break;
                        }
                        continue;
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                    Err(mpsc::error::TryRecvError::Empty) if interval.is_zero() => break,
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
                tokio::select! {
                    biased;
                    _ = stop.changed() => {
                        stopping = true;
                        break;
                    }
                    () = &mut deadline => break,
                    item = rx.recv() => match item {
                        Some(item) => if self.take(item).await { break },
                        None => break,
                    },
                }
            }
            self.publish().await;
        }
    }

    /// Encodes and sends the buffered events as one batch (no-op when empty).
    async fn publish(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let batch = EventBatch {
            ts: now_ts(),
            events: &self.buf,
            dp_rank: self.dp_rank,
        };
        let payload = match batch.encode() {
            Ok(payload) => Bytes::from(payload),
            Err(error) => {
                // Unreachable for validated events; counted and logged rather than hidden.
                if bump(&self.counters.encode_errors, 1) == 0 {
                    tracing::error!(%error, events = self.buf.len(), "KV event batch failed to encode; dropped");
                }
                self.buf.clear();
                self.charges.clear();
                return;
            }
        };
        let seq = self.seq;
        self.seq += 1;
        // Into the ring before the wire, so any seq a subscriber sees live is replayable
        // (while the ring keeps it).
        if let Some(ring) = &self.ring {
            let shares = ring_shares(self.charges.iter().filter_map(QueueCharge::share));
            ring.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(seq, payload.clone(), shares);
        }
        let len = payload.len() as u64;
        let frames = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        let msg = ZmqMessage::try_from(frames).expect("three frames");
        if let Err(error) = self.socket.send(msg).await {
            // PUB never blocks and drops for absent or slow subscribers; replay covers it.
            tracing::debug!(%error, seq, "PUB send failed; batch stays replayable");
        }
        self.charges.clear();
        for event in self.buf.drain(..) {
            let i = kind_index(event.event().kind());
            bump(&self.counters.events[i], 1);
            bump(&self.counters.blocks[i], event.event().block_count() as u64);
        }
        bump(&self.counters.batches, 1);
        bump(&self.counters.bytes, len);
        self.counters
            .next_seq
            .store(self.seq, std::sync::atomic::Ordering::Relaxed);
    }
}
