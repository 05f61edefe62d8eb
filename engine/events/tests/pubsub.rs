//! Real sockets on loopback: a SUB sees every batch with consecutive seq, a late subscriber
//! recovers through the replay ROUTER, invalid events never reach the wire, shutdown flushes.
//! Run: `cargo test --release -p kvnode-events --test pubsub`.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Sub, decode_events, dynamo_decode, read_replay, replay, without_probes};
use kvnode_events::{
    Access, BlockRemoved, BlockStored, KvEvent, Medium, Publisher, PublisherConfig, PublisherError,
    RejectReason, SinkError, Stats,
};
use zeromq::{DealerSocket, Socket, SocketSend, ZmqMessage};

/// Loopback tcp, which these tests may read: the switch that allows tcp at all.
fn tcp(endpoint: &str) -> PublisherConfig {
    PublisherConfig::new(endpoint).with_access(Access {
        tcp_readable_by_anyone: true,
        ..Access::default()
    })
}

fn config() -> PublisherConfig {
    tcp("tcp://127.0.0.1:0").with_replay("tcp://127.0.0.1:0")
}

fn store(i: u64) -> KvEvent {
    let parent = i.checked_sub(1).map(|p| p + 1000);
    KvEvent::Stored(
        BlockStored::new(Medium::CpuPinned, 2)
            .with_parent(parent)
            .block(i + 1000, &[i as u32, 7]),
    )
}

/// Polls the publisher's counters until `done` holds (the counters trail the wire slightly).
async fn eventually(publisher: &Publisher, done: impl Fn(&Stats) -> bool) -> Stats {
    let start = Instant::now();
    loop {
        let stats = publisher.stats();
        if done(&stats) {
            return stats;
        }
        assert!(
            start.elapsed() < common::WAIT,
            "counters never settled: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn subscriber_receives_every_batch_with_consecutive_seq() {
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 8,
        ..config()
    })
    .unwrap();
    assert!(
        !publisher.endpoint().ends_with(":0"),
        "{}",
        publisher.endpoint()
    );
    let sink = publisher.sink();
    let mut sub = Sub::connect(publisher.endpoint()).await;
    let mut expected_seq = sub.warm_up(&sink).await + 1;
    let sent: Vec<KvEvent> = (0..500).map(store).collect();
    for event in &sent {
        sink.submit(event.clone()).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < sent.len() {
        let (seq, payload) = sub.recv().await;
        assert_eq!(seq, expected_seq, "no gap, no reorder");
        expected_seq += 1;
        let events = decode_events(&payload);
        assert!(events.len() <= 8, "batches stay small");
        got.extend(without_probes(events));
    }
    assert_eq!(got, sent);
    let stats = eventually(&publisher, |s| s.next_seq == expected_seq).await;
    assert_eq!(stats.batches, expected_seq);
    assert_eq!(stats.blocks(kvnode_events::EventKind::Stored), 500);
    assert_eq!(stats.dropped_total() + stats.rejected_total(), 0);
}

#[tokio::test]
async fn late_subscriber_recovers_missed_batches_through_replay() {
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 4,
        ..config()
    })
    .unwrap();
    let sink = publisher.sink();
    let early: Vec<KvEvent> = (0..40).map(store).collect();
    for event in &early {
        sink.submit(event.clone()).unwrap();
    }
    eventually(&publisher, |s| s.events_total() == 40).await;
    // Nobody listened: the PUB socket dropped these, the ring kept them.
    let mut sub = Sub::connect(publisher.endpoint()).await;
    let live_seq = sub.warm_up(&sink).await;
    assert!(live_seq >= 10, "40 events in batches of <= 4 came first");

    let replayed = replay(publisher.replay_endpoint().unwrap(), 0).await;
    let seqs: Vec<u64> = replayed.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "from 0, consecutive"
    );
    assert!(
        seqs.contains(&live_seq),
        "replay covers the first live batch too"
    );
    let before_live: Vec<KvEvent> = replayed
        .iter()
        .filter(|(s, _)| *s < live_seq)
        .flat_map(|(_, p)| decode_events(p))
        .collect();
    assert_eq!(
        without_probes(before_live),
        early,
        "every missed event recovered"
    );
    let stats = eventually(&publisher, |s| s.replay_requests == 1).await;
    assert_eq!(stats.replay_batches, seqs.len() as u64);
}

#[tokio::test]
async fn replay_from_an_evicted_seq_starts_at_the_oldest_kept_batch() {
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 1,
        replay_ring_len: 4,
        ..config()
    })
    .unwrap();
    let sink = publisher.sink();
    for i in 0..10 {
        sink.submit(store(i)).unwrap();
    }
    eventually(&publisher, |s| s.next_seq == 10).await;
    let ep = publisher.replay_endpoint().unwrap();
    let seqs = |v: Vec<(u64, Bytes)>| v.into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(seqs(replay(ep, 0).await), [6, 7, 8, 9]);
    assert_eq!(seqs(replay(ep, 8).await), [8, 9]);
    assert!(
        replay(ep, 10).await.is_empty(),
        "nothing newer: only the end marker"
    );
    let last = replay(ep, 9).await;
    assert_eq!(decode_events(&last[0].1), [store(9)]);
}

#[tokio::test]
async fn malformed_replay_request_is_ignored_and_counted() {
    let publisher = Publisher::start(config()).unwrap();
    publisher.sink().submit(store(0)).unwrap();
    eventually(&publisher, |s| s.next_seq == 1).await;
    let mut dealer = DealerSocket::new();
    dealer
        .connect(publisher.replay_endpoint().unwrap())
        .await
        .unwrap();
    let bad = vec![Bytes::new(), Bytes::from_static(b"abc")];
    dealer
        .send(ZmqMessage::try_from(bad).unwrap())
        .await
        .unwrap();
    let good = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
    dealer
        .send(ZmqMessage::try_from(good).unwrap())
        .await
        .unwrap();
    // The first answer on the wire belongs to the good request: the bad one got none.
    let answer = read_replay(&mut dealer).await;
    assert_eq!(answer.len(), 1);
    assert_eq!(decode_events(&answer[0].1), [store(0)]);
    let stats = eventually(&publisher, |s| s.replay_requests == 1).await;
    assert_eq!(stats.replay_bad_requests, 1);
}

#[tokio::test]
async fn invalid_events_are_counted_and_never_reach_the_wire() {
    let publisher = Publisher::start(config()).unwrap();
    let sink = publisher.sink();
    let mut sub = Sub::connect(publisher.endpoint()).await;
    sub.warm_up(&sink).await;
    let short_tokens = KvEvent::Stored(BlockStored::new(Medium::Disk, 4).block(1, &[1, 2]));
    let self_parent = KvEvent::Stored(
        BlockStored::new(Medium::Disk, 1)
            .with_parent(Some(5))
            .block(5, &[1]),
    );
    let empty_remove = KvEvent::Removed(BlockRemoved {
        block_hashes: vec![],
        medium: Medium::CpuPinned,
    });
    let mut valid = Vec::new();
    for i in 0..30 {
        let bad = [&short_tokens, &self_parent, &empty_remove][i as usize % 3].clone();
        assert!(matches!(sink.submit(bad), Err(SinkError::Rejected(_))));
        sink.submit(store(i)).unwrap();
        valid.push(store(i));
    }
    let mut got = Vec::new();
    while got.len() < valid.len() {
        let (_, payload) = sub.recv().await;
        got.extend(without_probes(decode_events(&payload)));
    }
    assert_eq!(got, valid, "only the valid events, in order");
    let stats = publisher.stats();
    assert_eq!(stats.rejected(RejectReason::TokenCountMismatch), 10);
    assert_eq!(stats.rejected(RejectReason::DuplicateBlockHash), 10);
    assert_eq!(stats.rejected(RejectReason::EmptyBlockHashes), 10);
    assert_eq!(stats.rejected_total(), 30);
}

/// The next `n` events `sub` receives (probes left out).
async fn recv_events(sub: &mut Sub, n: usize) -> Vec<KvEvent> {
    let mut got = Vec::new();
    while got.len() < n {
        let (_, payload) = sub.recv().await;
        got.extend(without_probes(decode_events(&payload)));
    }
    got
}

#[tokio::test]
async fn shutdown_publishes_queued_events_then_sinks_report_closed() {
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 2,
        flush_interval: Duration::from_secs(30),
        ..config()
    })
    .unwrap();
    let sink = publisher.sink();
    let mut sub = Sub::connect(publisher.endpoint()).await;
    // Probes pair up into full batches of 2, so warm-up does not wait out the interval.
    sub.warm_up(&sink).await;
    let sent: Vec<KvEvent> = (0..5).map(store).collect();
    for event in &sent {
        sink.submit(event.clone()).unwrap();
    }
    let stats = tokio::task::spawn_blocking(move || publisher.shutdown())
        .await
        .unwrap();
    let got = recv_events(&mut sub, sent.len()).await;
    assert_eq!(
        got, sent,
        "the odd last event went out at shutdown, not after 30 s"
    );
    assert_eq!(stats.dropped_total(), 0);
    assert_eq!(sink.cleared(), Err(SinkError::Closed));
    assert_eq!(sink.stats().dropped_closed, 1);
}

/// A takeover's old daemon releases its publisher before its successor starts: the queued
/// events still reach a connected subscriber, and a new publisher binds the same PUB and
/// replay endpoints while the old one lingers (a long linger here: without the release, the
/// bind would fail until it ends).
#[tokio::test]
async fn a_released_publisher_frees_its_endpoints_while_it_lingers() {
    let mut old = Publisher::start(PublisherConfig {
        max_batch_events: 2,
        flush_interval: Duration::from_secs(30),
        linger: Duration::from_secs(20),
        ..config()
    })
    .unwrap();
    let (endpoint, replay) = (
        old.endpoint().to_owned(),
        old.replay_endpoint().unwrap().to_owned(),
    );
    let sink = old.sink();
    let mut sub = Sub::connect(&endpoint).await;
    sub.warm_up(&sink).await;
    let sent: Vec<KvEvent> = (0..3).map(store).collect();
    for event in &sent {
        sink.submit(event.clone()).unwrap();
    }
    let t = Instant::now();
    let old = tokio::task::spawn_blocking(move || {
        old.release(Duration::from_secs(5));
        old
    })
    .await
    .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "release waited out the linger"
    );
    let next = Publisher::start(tcp(&endpoint).with_replay(&replay))
        .expect("the successor binds the released endpoints");
    let got = recv_events(&mut sub, sent.len()).await;
    assert_eq!(
        got, sent,
        "the old publisher's last events reached its subscriber"
    );
    drop(next);
    std::mem::forget(old);
}

#[tokio::test]
async fn events_from_many_threads_keep_each_threads_order() {
    let publisher = Publisher::start(config()).unwrap();
    let mut sub = Sub::connect(publisher.endpoint()).await;
    sub.warm_up(&publisher.sink()).await;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let sink = publisher.sink();
            std::thread::spawn(move || {
                for i in 0..250u64 {
                    sink.removed(Medium::CpuPinned, vec![(t << 32) | i])
                        .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut next = [0u64; 4];
    let mut count = 0;
    while count < 1000 {
        let (_, payload) = sub.recv().await;
        for event in without_probes(decode_events(&payload)) {
            let KvEvent::Removed(r) = event else {
                panic!("{event:?}")
            };
            let (t, i) = (
                (r.block_hashes[0] >> 32) as usize,
                r.block_hashes[0] & 0xFFFF_FFFF,
            );
            assert_eq!(i, next[t], "thread {t} out of order");
            next[t] += 1;
            count += 1;
        }
    }
}

#[tokio::test]
async fn dp_rank_is_written_into_every_batch() {
    let publisher = Publisher::start(config().with_dp_rank(Some(2))).unwrap();
    let mut sub = Sub::connect(publisher.endpoint()).await;
    sub.warm_up(&publisher.sink()).await;
    publisher.sink().submit(store(1)).unwrap();
    loop {
        let (_, payload) = sub.recv().await;
        let batch = dynamo_decode(&payload);
        assert_eq!(batch.data_parallel_rank, Some(2));
        if !without_probes(decode_events(&payload)).is_empty() {
            break;
        }
    }
}

#[tokio::test]
async fn a_taken_port_is_reported_as_a_bind_error() {
    let first = Publisher::start(tcp("tcp://127.0.0.1:0")).unwrap();
    let err = Publisher::start(tcp(first.endpoint())).unwrap_err();
    assert!(
        matches!(err, PublisherError::Bind { socket: "PUB", .. }),
        "{err}"
    );
    let replay_taken = config().with_replay(first.endpoint());
    let err = Publisher::start(replay_taken).unwrap_err();
    assert!(
        matches!(
            err,
            PublisherError::Bind {
                socket: "replay ROUTER",
                ..
            }
        ),
        "{err}"
    );
}

/// A private directory for ipc sockets (mode 0755: the socket's own mode decides).
fn ipc_dir(tag: &str) -> std::path::PathBuf {
    use std::os::unix::fs::DirBuilderExt;
    let d = std::env::temp_dir().join(format!("kvnode-events-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().mode(0o755).create(&d).unwrap();
    d
}

#[tokio::test]
async fn ipc_endpoints_publish_and_replay_with_the_configured_mode() {
    use std::os::unix::fs::PermissionsExt;
    let d = ipc_dir("ipc");
    let ep = format!("ipc://{}", d.join("ev.sock").display());
    let rp = format!("ipc://{}", d.join("replay.sock").display());
    let publisher = Publisher::start(PublisherConfig::new(&ep).with_replay(&rp)).unwrap();
    assert_eq!(
        (publisher.endpoint(), publisher.replay_endpoint()),
        (ep.as_str(), Some(rp.as_str()))
    );
    for f in ["ev.sock", "replay.sock"] {
        let mode = std::fs::metadata(d.join(f)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    let sink = publisher.sink();
    let mut sub = Sub::connect(&ep).await;
    let first = sub.warm_up(&sink).await;
    sink.submit(store(1)).unwrap();
    let (seq, payload) = sub.recv().await;
    assert_eq!(seq, first + 1);
    assert_eq!(decode_events(&payload), vec![store(1)]);
    let all = replay(&rp, 0).await;
    assert_eq!(all.last().map(|(s, _)| *s), Some(seq));
    drop(publisher);
    assert!(!d.join("ev.sock").exists() && !d.join("replay.sock").exists());
    let _ = std::fs::remove_dir_all(d);
}

#[tokio::test]
async fn without_a_replay_endpoint_no_ring_is_kept() {
    let publisher = Publisher::start(tcp("tcp://127.0.0.1:0")).unwrap();
    let sink = publisher.sink();
    for i in 0..50 {
        sink.submit(store(i)).unwrap();
    }
    let s = eventually(&publisher, |s| s.events_total() == 50).await;
    assert_eq!((s.ring_bytes, s.ring_batches), (0, 0));
}

#[tokio::test]
async fn the_ring_stays_within_its_byte_bound() {
    let publisher = Publisher::start(PublisherConfig {
        max_batch_events: 1,
        replay_ring_bytes: 4096,
        ..config()
    })
    .unwrap();
    let sink = publisher.sink();
    let big = |i: u64| {
        KvEvent::Stored(BlockStored::new(Medium::CpuPinned, 256).block(i, &[0xFFFF_FFF0; 256]))
    };
    for i in 0..40 {
        sink.submit(big(i)).unwrap();
    }
    let s = eventually(&publisher, |s| s.events_total() == 40).await;
    assert!(s.ring_bytes <= 4096 && s.ring_batches >= 1, "{s:?}");
    assert_eq!(s.ring_evicted + s.ring_batches, 40, "{s:?}");
    let kept = replay(publisher.replay_endpoint().unwrap(), 0).await;
    assert_eq!(kept.len() as u64, s.ring_batches);
    assert!(kept.iter().map(|(_, p)| p.len()).sum::<usize>() <= 4096);
}
