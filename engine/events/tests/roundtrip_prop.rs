//! Property tests: random event sequences, batched as the publisher batches them, decode with
//! Dynamo's real parser to the same events; random corruptions are always rejected before
//! batching. Run: `cargo test --release -p kvnode-events --test roundtrip_prop`.

mod common;

use common::{assert_normalizes_to, decode_events, dynamo_decode};
use dynamo_kv_router::zmq_wire::ZmqEventNormalizer;
use kvnode_events::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium, RejectReason,
    ValidEvent, validate,
};
use proptest::prelude::*;

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![Just(Medium::CpuPinned), Just(Medium::Disk)]
}

fn hash() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0..16u64,
        Just(u64::MAX),
        Just(i64::MAX as u64 + 1)
    ]
}

fn stored(block_size: u32) -> impl Strategy<Value = KvEvent> {
    (
        prop::collection::hash_set(hash(), 1..6),
        proptest::option::of(hash()),
        medium(),
        proptest::option::of("[a-z0-9:_-]{1,12}"),
        any::<u32>(),
    )
        .prop_filter_map(
            "parent repeats a block",
            move |(set, parent, medium, salt, seed)| {
                if parent.is_some_and(|p| set.contains(&p)) {
                    return None;
                }
                let hashes: Vec<u64> = set.into_iter().collect();
                let tokens: Vec<u32> = (0..hashes.len() as u32 * block_size)
                    .map(|i| seed.wrapping_add(i.wrapping_mul(2_654_435_761)))
                    .collect();
                Some(KvEvent::Stored(BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids: tokens,
                    block_size,
                    medium,
                    cache_salt: salt,
                }))
            },
        )
}

fn removed() -> impl Strategy<Value = KvEvent> {
    (prop::collection::vec(hash(), 1..6), medium()).prop_map(|(block_hashes, medium)| {
        KvEvent::Removed(BlockRemoved {
            block_hashes,
            medium,
        })
    })
}

fn event(block_size: u32) -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        6 => stored(block_size),
        3 => removed(),
        1 => Just(KvEvent::Cleared(AllBlocksCleared)),
    ]
}

fn encode(events: &[ValidEvent], dp_rank: Option<u32>) -> Vec<u8> {
    EventBatch {
        ts: 1.0,
        events,
        dp_rank,
    }
    .encode()
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The bytes an event is charged (queue and replay ring) bound its encoded size, so
    /// a ring's per-tenant charges never under-count what it keeps.
    #[test]
    fn an_events_footprint_bounds_its_encoding(e in event(4)) {
        let valid = ValidEvent::try_from(e).unwrap();
        let encoded = rmp_serde::to_vec(&valid).unwrap().len() as u64;
        prop_assert!(valid.footprint() >= encoded, "{} < {encoded}", valid.footprint());
    }


    #[test]
    fn random_sequences_decode_to_the_same_events(
        block_size in prop_oneof![Just(1u32), Just(16), Just(64)],
        events in prop::collection::vec(event(16), 0..40),
        max_batch in 1usize..10,
        dp_rank in proptest::option::of(0u32..8),
    ) {
        // Re-size stores to the drawn block size (tokens must stay exact).
        let events: Vec<KvEvent> = events.into_iter().map(|e| match e {
            KvEvent::Stored(mut s) => {
                s.block_size = block_size;
                s.token_ids.resize(s.block_hashes.len() * block_size as usize, 7);
                KvEvent::Stored(s)
            }
            other => other,
        }).collect();
        let valid: Vec<ValidEvent> =
            events.iter().cloned().map(|e| validate(e).expect("generated events are valid")).collect();
        let mut decoded = Vec::new();
        for (seq, chunk) in valid.chunks(max_batch).enumerate() {
            let payload = encode(chunk, dp_rank);
            let batch = dynamo_decode(&payload);
            prop_assert_eq!(batch.data_parallel_rank, dp_rank.map(|r| i32::try_from(r).unwrap()));
            decoded.extend(decode_events(&payload));
            for (raw, intended) in batch.events.into_iter().zip(chunk) {
                // A fresh normalizer per event: random hashes reuse parents across salts,
                // which the router's namespace propagation (pinned in dynamo_decode) treats
                // as ambiguous; here only the per-event mapping is under test.
                let mut normalizer = ZmqEventNormalizer::new(block_size);
                assert_normalizes_to(&mut normalizer, raw, intended.event(), seq as u64);
            }
        }
        prop_assert_eq!(decoded, events);
    }

    #[test]
    fn corrupted_stores_are_rejected_with_the_right_reason(
        base in stored(8),
        corruption in 0usize..5,
        extra in 1usize..8,
    ) {
        let KvEvent::Stored(mut s) = base else { unreachable!() };
        let reason = match corruption {
            0 => { s.token_ids.truncate(s.token_ids.len() - 1); RejectReason::TokenCountMismatch }
            1 => { s.token_ids.extend(std::iter::repeat_n(0, extra)); RejectReason::TokenCountMismatch }
            2 => { let h = s.block_hashes[0]; s.block_hashes.push(h); s.token_ids.extend([0; 8]); RejectReason::DuplicateBlockHash }
            3 => { s.cache_salt = Some(String::new()); RejectReason::EmptySalt }
            _ => { s.block_hashes.clear(); s.token_ids.clear(); RejectReason::EmptyBlockHashes }
        };
        let err = validate(KvEvent::Stored(s)).expect_err("corruption must be caught");
        prop_assert_eq!(err.reason(), reason);
    }
}
