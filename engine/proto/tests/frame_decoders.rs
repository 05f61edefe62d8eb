//! Property tests of the client frame decoders (the stable-toolchain counterpart of
//! `fuzz/fuzz_targets/client_frame.rs`): arbitrary bytes never panic, and every request and
//! reply round-trips. More cases: `PROPTEST_CASES=5000 cargo xtask fuzz-smoke`.

use kvnode_proto::client::{
    AllocSlot, CommitStatus, ErrorCode, Extent, GetMode, Op, PutStatus, Reply, Response,
};
use kvnode_proto::frame::{FramePrefix, decode_header, encode_frame};
use kvnode_proto::plan::{FetchPlan, PlanReason, PlanRun, PlanSource, ReadPath, RecomputeCost};
use kvnode_proto::{Digest, Key, NamespaceSpec, Request};
use proptest::prelude::*;

fn key() -> impl Strategy<Value = Key> + Clone {
    (any::<[u8; 32]>(), any::<u16>()).prop_map(|(d, s)| Key(Digest(d), s))
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || proptest::collection::vec(key(), 0..20);
    prop_oneof![
        (any::<u32>(), ".{0,20}").prop_map(|(version, client)| Op::Hello { version, client }),
        (
            ".{0,10}",
            1u32..512,
            proptest::collection::vec(1u64..1 << 30, 1..4)
        )
            .prop_map(|(model, page_size, segments)| Op::Register {
                spec: NamespaceSpec {
                    model,
                    page_size,
                    segments,
                    ..NamespaceSpec::default()
                }
            }),
        (
            any::<u32>(),
            keys(),
            proptest::collection::vec(any::<u64>(), 0..20)
        )
            .prop_map(|(ns, keys, lens)| Op::Put {
                ns,
                keys,
                lens,
                meta: vec![]
            }),
        (
            any::<u32>(),
            keys(),
            proptest::collection::vec(any::<u64>(), 0..20)
        )
            .prop_map(|(ns, keys, lens)| Op::Alloc {
                ns,
                keys,
                lens,
                meta: vec![]
            }),
        proptest::collection::vec(any::<u64>(), 0..10).prop_map(|handles| Op::Commit { handles }),
        (any::<u32>(), keys(), any::<bool>()).prop_map(|(ns, keys, l)| Op::Get {
            ns,
            keys,
            mode: if l { GetMode::Lease } else { GetMode::Inline },
            hint: l.then(|| "{}".to_owned()),
            deadline_ms: l.then_some(5),
        }),
        any::<u64>().prop_map(|lease| Op::Release { lease }),
        (any::<u32>(), keys(), proptest::option::of(recompute())).prop_map(
            |(ns, keys, recompute)| Op::Exists {
                ns,
                keys,
                hint: None,
                recompute,
            }
        ),
        (any::<u32>(), keys()).prop_map(|(ns, keys)| Op::Delete { ns, keys }),
        (any::<u32>(), keys()).prop_map(|(ns, keys)| Op::Touch { ns, keys }),
        proptest::option::of(any::<u32>()).prop_map(|ns| Op::Clear { ns }),
        Just(Op::Stats),
    ]
}

fn recompute() -> impl Strategy<Value = RecomputeCost> {
    (
        1u32..4096,
        1u32..8,
        1.0f64..1e6,
        0.0f64..1e-6,
        any::<u32>(),
        0u8..3,
    )
        .prop_map(
            |(page_tokens, keys_per_page, tokens_per_s, quad_s, start, via)| RecomputeCost {
                ctx_s: None,
                prompt_tokens: None,
                page_tokens,
                keys_per_page,
                tokens_per_s,
                quad_s,
                start_tokens: u64::from(start),
                via: [ReadPath::Copy, ReadPath::Region, ReadPath::Gpu][usize::from(via)],
            },
        )
}

fn plan() -> impl Strategy<Value = FetchPlan> {
    (
        any::<u32>(),
        any::<u32>(),
        0.0f64..1e3,
        0.0f64..1e3,
        ".{0,40}",
    )
        .prop_map(|(keys, available, fetch_s, recompute_s, note)| FetchPlan {
            keys,
            runs: vec![PlanRun {
                source: PlanSource::Nvme,
                keys,
            }],
            fetch_s,
            recompute_s,
            reason: PlanReason::Slower,
            cut_by: Some(PlanSource::Peer),
            available,
            note,
        })
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        proptest::collection::vec(
            prop_oneof![
                Just(PutStatus::Stored),
                Just(PutStatus::NoSpace),
                Just(PutStatus::TooLarge)
            ],
            0..8
        )
        .prop_map(|results| Reply::Put { results }),
        proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..8).prop_map(|v| {
            Reply::Alloc {
                slots: v
                    .into_iter()
                    .map(|(handle, offset, len)| AllocSlot::Granted {
                        handle,
                        offset,
                        len,
                    })
                    .collect(),
            }
        }),
        proptest::collection::vec(Just(CommitStatus::Committed), 0..4)
            .prop_map(|results| Reply::Commit { results }),
        proptest::collection::vec(proptest::option::of(any::<u64>()), 0..8)
            .prop_map(|lens| Reply::GetInline { lens, pull: None }),
        (
            any::<u64>(),
            proptest::collection::vec(proptest::option::of((any::<u64>(), any::<u64>())), 0..8)
        )
            .prop_map(|(lease, e)| Reply::GetLease {
                lease,
                extents: e
                    .into_iter()
                    .map(|x| x.map(|(offset, len)| Extent { offset, len }))
                    .collect(),
                pull: None,
            }),
        (any::<u32>(), proptest::option::of(plan())).prop_map(|(count, plan)| Reply::Exists {
            count,
            pull: None,
            plan: plan.map(Box::new),
        }),
        ".{0,40}".prop_map(|message| Reply::Error {
            code: ErrorCode::Invalid,
            message
        }),
    ]
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_frame_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if bytes.len() >= 8 {
            let _ = FramePrefix::decode(bytes[..8].try_into().unwrap());
        }
        let _ = decode_header::<Request>(&bytes);
        let _ = decode_header::<Response>(&bytes);
    }

    #[test]
    fn every_request_round_trips_through_a_frame(id in any::<u64>(), op in op(), payload in 0u64..1 << 20) {
        let req = Request { id, op };
        let f = encode_frame(&req, payload).unwrap();
        let p = FramePrefix::decode(f[..8].try_into().unwrap()).unwrap();
        prop_assert_eq!(u64::from(p.payload_len), payload);
        prop_assert_eq!(decode_header::<Request>(&f[8..]).unwrap(), req);
    }

    #[test]
    fn every_reply_round_trips_through_a_frame(id in any::<u64>(), reply in reply()) {
        let r = Response { id, reply };
        let f = encode_frame(&r, 0).unwrap();
        prop_assert_eq!(decode_header::<Response>(&f[8..]).unwrap(), r);
    }

    #[test]
    fn truncated_valid_frames_are_decode_errors_not_panics(op in op(), cut in 0usize..64) {
        let f = encode_frame(&Request { id: 1, op }, 0).unwrap();
        let body = &f[8..];
        let cut = cut.min(body.len().saturating_sub(1));
        prop_assert!(decode_header::<Request>(&body[..cut]).is_err());
    }
}
