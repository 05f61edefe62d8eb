//! An events reader the attack tests run as another uid (`tests/tests/attack_events.rs`):
//! it subscribes to a KV events PUB endpoint and asks its replay endpoint for everything (a
//! replay from seq 0, then a residency snapshot), as a router would, decodes every batch
//! with Dynamo's parser and prints what it read as `key value` lines.
//!
//! `event_spy PUB_ENDPOINT REPLAY_ENDPOINT MILLIS`
//!
//! Prints `sub` / `replay` / `snapshot` (`connected`, or the error), `live_batches`,
//! `replay_batches`, `snapshot_batches`, `stored_tokens` (token ids seen in `BlockStored`
//! events, live, replayed and in the snapshot) and `salts`
//! (the cache namespaces seen, comma separated).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dynamo_kv_router::zmq_wire::{RawKvEvent, decode_event_batch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

#[derive(Default)]
struct Seen {
    batches: u64,
    tokens: u64,
    salts: BTreeSet<String>,
}

impl Seen {
    fn batch(&mut self, payload: &[u8]) {
        self.batches += 1;
        let Ok(b) = decode_event_batch(payload) else {
            return;
        };
        for e in b.events {
            if let RawKvEvent::BlockStored {
                token_ids,
                cache_namespace,
                ..
            } = e
            {
                self.tokens += token_ids.len() as u64;
                self.salts.extend(cache_namespace);
            }
        }
    }
}

/// Subscribes, retrying a refused connection (as a patient attacker would) until `until`.
async fn live(endpoint: &str, until: Instant, seen: &mut Seen) -> String {
    let mut s = SubSocket::new();
    loop {
        let error = match tokio::time::timeout(Duration::from_secs(1), s.connect(endpoint)).await {
            Ok(Ok(())) => break,
            Ok(Err(e)) => format!("error {e}").replace('\n', " "),
            Err(_) => "error timed out".into(),
        };
        if Instant::now() >= until {
            return error;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Err(e) = s.subscribe("").await {
        return format!("error {e}");
    }
    while let Ok(Ok(m)) = tokio::time::timeout_at(until.into(), s.recv()).await {
        if let Some(p) = m.get(2) {
            seen.batch(p);
        }
    }
    "connected".into()
}

/// Sends `body` (a start seq, or the snapshot request) to the replay endpoint and reads the
/// answer up to its end marker.
async fn replay(endpoint: &str, body: Bytes, seen: &mut Seen) -> String {
    let mut d = DealerSocket::new();
    let connected = tokio::time::timeout(Duration::from_secs(2), d.connect(endpoint)).await;
    match connected {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return format!("error {e}").replace('\n', " "),
        Err(_) => return "error timed out".into(),
    }
    let req = vec![Bytes::new(), body];
    if let Err(e) = d.send(ZmqMessage::try_from(req).expect("frames")).await {
        return format!("error {e}");
    }
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(3), d.recv()).await {
        let (Some(seq), Some(p)) = (m.get(1), m.get(2)) else {
            continue;
        };
        if seq.as_ref() == (-1i64).to_be_bytes() {
            break;
        }
        seen.batch(p);
    }
    "connected".into()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, pub_ep, replay_ep, millis] = args.as_slice() else {
        panic!("usage: event_spy PUB_ENDPOINT REPLAY_ENDPOINT MILLIS");
    };
    let until = Instant::now() + Duration::from_millis(millis.parse().expect("MILLIS"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (mut l, mut r, mut n) = (Seen::default(), Seen::default(), Seen::default());
    let (sub, rep, snap) = rt.block_on(async {
        let sub = live(pub_ep, until, &mut l).await;
        let from_0 = Bytes::copy_from_slice(&0u64.to_be_bytes());
        let rep = replay(replay_ep, from_0, &mut r).await;
        let ask = Bytes::from_static(b"kvnode:snapshot");
        let snap = replay(replay_ep, ask, &mut n).await;
        (sub, rep, snap)
    });
    println!("sub {sub}");
    println!("replay {rep}");
    println!("snapshot {snap}");
    println!("live_batches {}", l.batches);
    println!("replay_batches {}", r.batches);
    println!("snapshot_batches {}", n.batches);
    println!("stored_tokens {}", l.tokens + r.tokens + n.tokens);
    let salts: BTreeSet<String> = l.salts.union(&r.salts).chain(&n.salts).cloned().collect();
    println!("salts {}", salts.into_iter().collect::<Vec<_>>().join(","));
}
