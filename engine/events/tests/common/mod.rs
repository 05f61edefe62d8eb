//! Test helpers: Dynamo's real decoder mapped back to kvnode types, and loopback SUB / DEALER clients.
#![allow(
    dead_code,
    reason = "each test binary uses a different subset of the helpers"
)]

use std::time::Duration;

use bytes::Bytes;
use dynamo_kv_router::protocols::{
    BlockHashOptions, KvCacheEventData, PlacementEvent, StorageTier, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{
    BlockHashValue, KvEventBatch, RawKvEvent, ZmqEventNormalizer, decode_event_batch,
};
use dynamo_kv_router::{LocalBlockHash, compute_block_hash_for_seq};
use kvnode_events::{AllBlocksCleared, BlockRemoved, BlockStored, EventSink, KvEvent, Medium};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Generous bound for any single socket wait on loopback.
pub const WAIT: Duration = Duration::from_secs(10);
/// Removal of this hash is the warm-up probe; tests filter it out.
pub const PROBE_HASH: u64 = 0xFFFF_FFFF_FFFF_FFF0;

/// Decodes a payload with Dynamo's production parser; panics with its error.
pub fn dynamo_decode(payload: &[u8]) -> KvEventBatch {
    decode_event_batch(payload).unwrap_or_else(|e| panic!("dynamo rejected the batch: {e}"))
}

fn medium_from_wire(m: Option<&str>) -> Medium {
    match m {
        Some("CPU_PINNED") => Medium::CpuPinned,
        Some("DISK") => Medium::Disk,
        other => panic!("unexpected medium {other:?}"),
    }
}

fn hashes(v: &[BlockHashValue]) -> Vec<u64> {
    v.iter().map(|h| h.into_u64()).collect()
}

/// Maps a decoded event back to the kvnode event it must have come from, asserting that
/// every slot kvnode leaves nil decoded as absent.
pub fn to_kvnode(raw: &RawKvEvent) -> KvEvent {
    match raw {
        RawKvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            lora_name,
            cache_namespace,
            block_mm_infos,
            group_idx,
            kv_cache_spec_kind,
            kv_cache_spec_sliding_window,
            locality,
            ownership,
            ..
        } => {
            assert!(lora_name.is_none() && block_mm_infos.is_none());
            assert!(group_idx.is_none() && kv_cache_spec_kind.is_none());
            assert!(kv_cache_spec_sliding_window.is_none() && locality.is_none());
            assert!(ownership.is_none());
            KvEvent::Stored(BlockStored {
                block_hashes: hashes(block_hashes),
                parent_block_hash: parent_block_hash.map(BlockHashValue::into_u64),
                token_ids: token_ids.clone(),
                block_size: u32::try_from(*block_size).unwrap(),
                medium: medium_from_wire(medium.as_deref()),
                cache_salt: cache_namespace.clone(),
            })
        }
        RawKvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
            locality,
            ownership,
            ..
        } => {
            assert!(group_idx.is_none() && locality.is_none() && ownership.is_none());
            KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(block_hashes),
                medium: medium_from_wire(medium.as_deref()),
            })
        }
        RawKvEvent::AllBlocksCleared { ownership } => {
            assert!(ownership.is_none());
            KvEvent::Cleared(AllBlocksCleared)
        }
        RawKvEvent::Ignored => panic!("kvnode never emits Ignored"),
    }
}

/// Decodes with Dynamo and maps every event back to kvnode's types.
pub fn decode_events(payload: &[u8]) -> Vec<KvEvent> {
    dynamo_decode(payload)
        .events
        .iter()
        .map(to_kvnode)
        .collect()
}

/// The router tier a kvnode medium must land in.
pub fn tier(medium: Medium) -> StorageTier {
    match medium {
        Medium::CpuPinned => StorageTier::HostPinned,
        Medium::Disk => StorageTier::Disk,
    }
}

/// The tokens hash the router must compute for each block of a store.
pub fn expected_tokens_hashes(e: &BlockStored) -> Vec<LocalBlockHash> {
    let options = BlockHashOptions {
        block_mm_infos: None,
        lora_name: None,
        cache_namespace: e.cache_salt.as_deref(),
        is_eagle: None,
    };
    compute_block_hash_for_seq(&e.token_ids, e.block_size, options)
}

/// Runs an event through Dynamo's normalizer and asserts it becomes exactly the intended
/// store / remove / clear, in the intended tier, with salted tokens hashes.
pub fn assert_normalizes_to(
    normalizer: &mut ZmqEventNormalizer,
    raw: RawKvEvent,
    intended: &KvEvent,
    event_id: u64,
) {
    let worker = WorkerWithDpRank::new(1, 0);
    let placed: PlacementEvent = normalizer
        .normalize(raw, event_id, worker)
        .unwrap_or_else(|| panic!("normalizer filtered {intended:?}"));
    match (intended, &placed.event.data) {
        (KvEvent::Stored(e), KvCacheEventData::Stored(data)) => {
            assert_eq!(placed.placement.tier, tier(e.medium));
            assert_eq!(data.parent_hash.map(|h| h.0), e.parent_block_hash);
            let got: Vec<u64> = data.blocks.iter().map(|b| b.block_hash.0).collect();
            assert_eq!(got, e.block_hashes, "every block indexed");
            let tokens: Vec<LocalBlockHash> = data.blocks.iter().map(|b| b.tokens_hash).collect();
            assert_eq!(
                tokens,
                expected_tokens_hashes(e),
                "tokens hashed with the salt"
            );
        }
        (KvEvent::Removed(e), KvCacheEventData::Removed(data)) => {
            assert_eq!(placed.placement.tier, tier(e.medium));
            let got: Vec<u64> = data.block_hashes.iter().map(|h| h.0).collect();
            assert_eq!(got, e.block_hashes);
        }
        (KvEvent::Cleared(_), KvCacheEventData::Cleared) => {}
        (want, got) => panic!("intended {want:?}, router saw {got:?}"),
    }
}

/// A loopback SUB with an empty subscription, as the router connects.
pub struct Sub(SubSocket);

impl std::fmt::Debug for Sub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sub")
    }
}

impl Sub {
    pub async fn connect(endpoint: &str) -> Self {
        let mut socket = SubSocket::new();
        socket.connect(endpoint).await.expect("SUB connects");
        socket.subscribe("").await.expect("SUB subscribes");
        Self(socket)
    }

    /// Next message within `wait`, checked to be exactly [empty topic, 8-byte seq, payload].
    pub async fn recv_within(&mut self, wait: Duration) -> Option<(u64, Bytes)> {
        let msg = tokio::time::timeout(wait, self.0.recv())
            .await
            .ok()?
            .expect("SUB recv");
        Some(split_live(&msg))
    }

    pub async fn recv(&mut self) -> (u64, Bytes) {
        self.recv_within(WAIT)
            .await
            .expect("a batch within the wait")
    }

    /// Sends probe removals until one arrives, so later batches cannot be lost to the
    /// subscription handshake. Returns the probe's seq.
    pub async fn warm_up(&mut self, sink: &EventSink) -> u64 {
        for _ in 0..200 {
            sink.removed(Medium::CpuPinned, vec![PROBE_HASH]).unwrap();
            if let Some((seq, _)) = self.recv_within(Duration::from_millis(50)).await {
                return seq;
            }
        }
        panic!("subscriber never received a probe");
    }
}

/// Splits a live message, asserting the 3-frame layout.
pub fn split_live(msg: &ZmqMessage) -> (u64, Bytes) {
    assert_eq!(msg.len(), 3, "exactly 3 frames");
    assert!(msg.get(0).unwrap().is_empty(), "empty topic");
    let seq = msg.get(1).unwrap();
    assert_eq!(seq.len(), 8, "8-byte seq");
    (
        u64::from_be_bytes(seq[..].try_into().unwrap()),
        msg.get(2).unwrap().clone(),
    )
}

/// Asks the replay socket for everything from `start_seq` as the router's DEALER does,
/// returning the batches before the `-1` end marker.
pub async fn replay(endpoint: &str, start_seq: u64) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.expect("DEALER connects");
    let request = vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ];
    dealer
        .send(ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    read_replay(&mut dealer).await
}

/// Reads `[empty, seq, payload]` messages until the `[empty, -1, ""]` end marker.
pub async fn read_replay(dealer: &mut DealerSocket) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .expect("replay answer")
            .unwrap();
        assert_eq!(msg.len(), 3, "[empty, seq, payload]");
        assert!(msg.get(0).unwrap().is_empty());
        let seq: [u8; 8] = msg.get(1).unwrap()[..].try_into().expect("8-byte seq");
        let payload = msg.get(2).unwrap().clone();
        if i64::from_be_bytes(seq) == -1 {
            assert!(payload.is_empty(), "end marker has an empty payload");
            return out;
        }
        out.push((u64::from_be_bytes(seq), payload));
    }
}

/// Drops the warm-up probes from a decoded event list.
pub fn without_probes(events: Vec<KvEvent>) -> Vec<KvEvent> {
    events
        .into_iter()
        .filter(|e| !matches!(e, KvEvent::Removed(r) if r.block_hashes == [PROBE_HASH]))
        .collect()
}
