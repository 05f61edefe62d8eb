//! Residency snapshots on the replay socket, with a stand-in residency source: the explicit
//! request, the answer to a replay the ring no longer covers, and what a large one costs.
//! Run: `cargo test --release -p kvnode-events --test snapshot -- --nocapture`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{decode_events, replay};
use kvnode_events::snapshot::{Entry, Marker};
use kvnode_events::{
    Access, AllBlocksCleared, Announced, BlockStored, EventSink, KvEvent, Medium, Publisher,
    PublisherConfig, SNAPSHOT_REQUEST, SnapshotSource,
};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn config(ring: usize) -> PublisherConfig {
    PublisherConfig {
        max_batch_events: 1,
        replay_ring_len: ring,
        ..PublisherConfig::new("tcp://127.0.0.1:0")
            .with_access(Access {
                tcp_readable_by_anyone: true,
                ..Access::default()
            })
            .with_replay("tcp://127.0.0.1:0")
    }
}

#[derive(Debug)]
struct Block(u64, Option<u64>);

impl Announced for Block {
    fn hash(&self) -> u64 {
        self.0
    }
    fn parent(&self) -> Option<u64> {
        self.1
    }
    fn stored(&self, medium: Medium) -> BlockStored {
        BlockStored::new(medium, 2)
            .with_parent(self.1)
            .block(self.0, &[self.0 as u32, 7])
    }
}

/// A residency source holding fixed entries, queueing the marker as the engine's does.
struct Source {
    sink: EventSink,
    entries: Vec<Entry>,
}

impl SnapshotSource for Source {
    fn snapshot(&self, marker: Marker) -> Result<Vec<Entry>, Marker> {
        let copy = self.entries.clone();
        self.sink.mark(marker)?;
        Ok(copy)
    }
}

fn serve(publisher: &Publisher, entries: Vec<Entry>) -> Arc<dyn SnapshotSource> {
    let source: Arc<dyn SnapshotSource> = Arc::new(Source {
        sink: publisher.sink(),
        entries,
    });
    publisher.sink().serve_snapshots(Arc::downgrade(&source));
    source
}

fn chain(n: u64) -> Vec<Entry> {
    // Children first, to show the answer reorders them.
    (0..n)
        .rev()
        .map(|h| {
            let b: Arc<dyn Announced> = Arc::new(Block(h + 1, h.checked_sub(1).map(|p| p + 1)));
            (Medium::CpuPinned, b)
        })
        .collect()
}

/// Sends the snapshot request: the batches (seq frame -2) and the end payload.
async fn ask(endpoint: &str) -> (Vec<Bytes>, Bytes) {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = vec![Bytes::new(), Bytes::from_static(SNAPSHOT_REQUEST)];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(common::WAIT, d.recv())
            .await
            .expect("an answer")
            .unwrap();
        let seq = i64::from_be_bytes(m.get(1).unwrap()[..].try_into().unwrap());
        if seq == -1 {
            return (out, m.get(2).unwrap().clone());
        }
        assert_eq!(seq, -2);
        out.push(m.get(2).unwrap().clone());
    }
}

fn hashes_stored(batches: &[Bytes]) -> Vec<u64> {
    let events: Vec<KvEvent> = batches.iter().flat_map(|b| decode_events(b)).collect();
    assert_eq!(
        events[0],
        KvEvent::Cleared(AllBlocksCleared),
        "a clear first"
    );
    events[1..]
        .iter()
        .map(|e| match e {
            KvEvent::Stored(s) => s.block_hashes[0],
            other => panic!("a snapshot holds stores only: {other:?}"),
        })
        .collect()
}

async fn published(publisher: &Publisher, n: u64) {
    let t0 = Instant::now();
    while publisher.stats().next_seq < n {
        assert!(t0.elapsed() < common::WAIT, "{:?}", publisher.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn without_a_source_a_snapshot_request_gets_only_the_end_marker() {
    let publisher = Publisher::start(config(16)).unwrap();
    let (batches, end) = ask(publisher.replay_endpoint().unwrap()).await;
    assert!(batches.is_empty() && end.is_empty(), "{batches:?} {end:?}");
}

#[tokio::test]
async fn a_snapshot_is_the_sources_blocks_parents_first_with_the_seq_after_every_queued_event() {
    let publisher = Publisher::start(config(16)).unwrap();
    let _source = serve(&publisher, chain(5));
    let sink = publisher.sink();
    for i in 0..3 {
        sink.removed(Medium::Disk, vec![100 + i]).unwrap();
    }
    let (batches, end) = ask(publisher.replay_endpoint().unwrap()).await;
    assert_eq!(hashes_stored(&batches), [1, 2, 3, 4, 5]);
    // The three events were queued before the marker: all in batches below S.
    assert_eq!(u64::from_be_bytes(end[..].try_into().unwrap()), 3);
}

#[tokio::test]
async fn a_replay_the_ring_no_longer_covers_gets_the_snapshot_under_s_minus_1_then_the_ring() {
    let publisher = Publisher::start(config(4)).unwrap();
    let _source = serve(&publisher, chain(3));
    let sink = publisher.sink();
    for i in 0..10 {
        sink.removed(Medium::Disk, vec![100 + i]).unwrap();
    }
    published(&publisher, 10).await;
    let ep = publisher.replay_endpoint().unwrap();
    let answer = replay(ep, 0).await;
    let seqs: Vec<u64> = answer.iter().map(|(s, _)| *s).collect();
    // One event a batch (max_batch_events 1): the clear and three stores, all under S - 1,
    // and nothing newer in the ring.
    assert_eq!(seqs, [9; 4], "the snapshot under S - 1 = 9");
    let payloads: Vec<Bytes> = answer.into_iter().map(|(_, p)| p).collect();
    assert_eq!(hashes_stored(&payloads), [1, 2, 3]);
    // A covered seq is still an ordinary replay.
    let kept: Vec<u64> = replay(ep, 7).await.into_iter().map(|(s, _)| s).collect();
    assert_eq!(kept, [7, 8, 9]);
    assert_eq!(publisher.stats().snapshots, 1);
}

/// A source whose copy holds its lock for 20 ms, recording when each copy started.
struct Slow {
    sink: EventSink,
    starts: std::sync::Mutex<Vec<Instant>>,
}

impl SnapshotSource for Slow {
    fn snapshot(&self, marker: Marker) -> Result<Vec<Entry>, Marker> {
        self.starts.lock().unwrap().push(Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        self.sink.mark(marker)?;
        Ok(Vec::new())
    }
}

/// Back-to-back snapshot requests do not hold the engine's lock more than a tenth of the
/// time: after a copy that took 20 ms the next one starts 9 × 20 ms after it ended.
#[tokio::test]
async fn a_flood_of_snapshot_requests_holds_the_source_at_most_a_tenth_of_the_time() {
    let publisher = Publisher::start(config(16)).unwrap();
    let slow = Arc::new(Slow {
        sink: publisher.sink(),
        starts: std::sync::Mutex::default(),
    });
    let source: Arc<dyn SnapshotSource> = slow.clone();
    publisher.sink().serve_snapshots(Arc::downgrade(&source));
    for _ in 0..4 {
        ask(publisher.replay_endpoint().unwrap()).await;
    }
    let starts = slow.starts.lock().unwrap().clone();
    assert_eq!(starts.len(), 4);
    for w in starts.windows(2) {
        let gap = w[1] - w[0];
        assert!(gap >= Duration::from_millis(195), "copies {gap:?} apart");
    }
}

/// Prints the cost of answering a snapshot of 100 000 blocks (encode and send, 64 events
/// a batch) to a DEALER on loopback.
#[tokio::test]
async fn snapshot_answer_cost() {
    const N: u64 = 100_000;
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 64,
        ..config(16)
    })
    .unwrap();
    let _source = serve(&publisher, chain(N));
    let t0 = Instant::now();
    let (batches, _) = ask(publisher.replay_endpoint().unwrap()).await;
    let took = t0.elapsed();
    let bytes: usize = batches.iter().map(Bytes::len).sum();
    assert_eq!(publisher.stats().snapshot_blocks, N);
    eprintln!(
        "snapshot of {N} blocks: {took:?} to answer, {} batches, {bytes} bytes ({} per block)",
        batches.len(),
        bytes as u64 / N
    );
}
