//! Pins the wire layout against Dynamo 1.6.1's own parser: every batch kind kvnode emits decodes
//! with `zmq_wire::decode_event_batch` and normalizes to the intended store / remove / clear,
//! medium and salt included. Run: `cargo test --release -p kvnode-events --test dynamo_decode`.

mod common;

use common::{assert_normalizes_to, decode_events, dynamo_decode, expected_tokens_hashes};
use dynamo_kv_router::zmq_wire::{RawKvEvent, ZmqEventNormalizer};
use kvnode_events::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium, ValidEvent,
    router_hash, validate,
};

const BLOCK: u32 = 4;

fn tokens(seed: u32) -> Vec<u32> {
    (0..BLOCK).map(|i| seed * 100 + i).collect()
}

fn encode(events: &[KvEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let valid: Vec<ValidEvent> = events
        .iter()
        .cloned()
        .map(|e| validate(e).unwrap())
        .collect();
    EventBatch {
        ts: 1_732_876_800.5,
        events: &valid,
        dp_rank,
    }
    .encode()
    .unwrap()
}

/// Encodes one batch, decodes it with Dynamo, and checks decode + normalization per event.
fn round_trip(events: &[KvEvent]) {
    let payload = encode(events, None);
    assert_eq!(
        decode_events(&payload),
        events,
        "decoded events equal the intended ones"
    );
    let batch = dynamo_decode(&payload);
    let mut normalizer = ZmqEventNormalizer::new(BLOCK);
    for (i, (raw, intended)) in batch.events.into_iter().zip(events).enumerate() {
        assert_normalizes_to(&mut normalizer, raw, intended, i as u64);
    }
}

#[test]
fn dram_store_of_a_chain_root_normalizes_to_host_pinned_blocks() {
    let e = BlockStored::new(Medium::CpuPinned, BLOCK)
        .block(11, &tokens(1))
        .block(12, &tokens(2));
    round_trip(&[KvEvent::Stored(e)]);
}

#[test]
fn disk_store_with_parent_and_salt_keeps_the_salt_in_the_tokens_hash() {
    let salted = BlockStored::new(Medium::Disk, BLOCK)
        .with_parent(Some(11))
        .with_salt(Some("tenant-a".into()))
        .block(21, &tokens(3))
        .block(22, &tokens(4))
        .block(23, &tokens(5));
    round_trip(&[KvEvent::Stored(salted.clone())]);
    let raw = dynamo_decode(&encode(&[KvEvent::Stored(salted.clone())], None));
    let RawKvEvent::BlockStored {
        cache_namespace,
        medium,
        lora_name,
        ..
    } = &raw.events[0]
    else {
        panic!("not a store: {:?}", raw.events[0]);
    };
    assert_eq!(cache_namespace.as_deref(), Some("tenant-a"));
    assert_eq!(medium.as_deref(), Some("DISK"));
    assert_eq!(
        lora_name, &None,
        "the salt never lands in the lora_name slot"
    );
    let unsalted = BlockStored {
        cache_salt: None,
        ..salted.clone()
    };
    assert_ne!(
        expected_tokens_hashes(&salted),
        expected_tokens_hashes(&unsalted)
    );
}

#[test]
fn dram_store_with_salt_normalizes_through_the_namespace_path() {
    let root = BlockStored::new(Medium::CpuPinned, BLOCK)
        .with_salt(Some("t".into()))
        .block(31, &tokens(6));
    let child = BlockStored::new(Medium::CpuPinned, BLOCK)
        .with_parent(Some(31))
        .with_salt(Some("t".into()))
        .block(32, &tokens(7));
    round_trip(&[KvEvent::Stored(root), KvEvent::Stored(child)]);
}

#[test]
fn removes_in_both_media_normalize_to_removals_in_that_tier() {
    round_trip(&[
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![11, 12],
            medium: Medium::CpuPinned,
        }),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![21],
            medium: Medium::Disk,
        }),
    ]);
}

#[test]
fn clear_normalizes_to_cleared() {
    round_trip(&[KvEvent::Cleared(AllBlocksCleared)]);
}

#[test]
fn mixed_batch_keeps_event_order() {
    round_trip(&[
        KvEvent::Stored(BlockStored::new(Medium::CpuPinned, BLOCK).block(1, &tokens(1))),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::CpuPinned,
        }),
        KvEvent::Stored(BlockStored::new(Medium::Disk, BLOCK).block(1, &tokens(1))),
        KvEvent::Cleared(AllBlocksCleared),
        KvEvent::Stored(BlockStored::new(Medium::CpuPinned, BLOCK).block(2, &tokens(2))),
    ]);
}

#[test]
fn hashes_above_i64_max_survive_as_u64() {
    let digest = [0xF0u8; 32];
    let big = router_hash(&digest);
    assert!(big > i64::MAX as u64);
    round_trip(&[
        KvEvent::Stored(
            BlockStored::new(Medium::CpuPinned, BLOCK)
                .with_parent(Some(u64::MAX))
                .block(big, &tokens(9)),
        ),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![big, 0],
            medium: Medium::CpuPinned,
        }),
    ]);
}

#[test]
fn batch_is_a_three_element_array_with_ts_and_dp_rank() {
    let payload = encode(&[KvEvent::Cleared(AllBlocksCleared)], Some(3));
    let value: rmpv::Value = rmp_serde::from_slice(&payload).unwrap();
    let slots = value.as_array().expect("an array, never a map");
    assert_eq!(slots.len(), 3);
    assert_eq!(slots[0].as_f64(), Some(1_732_876_800.5));
    let batch = dynamo_decode(&payload);
    assert_eq!(batch.data_parallel_rank, Some(3));
    assert!((batch.ts - 1_732_876_800.5).abs() < f64::EPSILON);
    let no_rank = dynamo_decode(&encode(&[KvEvent::Cleared(AllBlocksCleared)], None));
    assert_eq!(no_rank.data_parallel_rank, None);
}

#[test]
fn empty_batch_still_decodes() {
    let payload = encode(&[], Some(0));
    assert!(dynamo_decode(&payload).events.is_empty());
}
