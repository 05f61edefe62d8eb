//! Property tests for the on-disk decoders (the same entry points the cargo-fuzz targets in
//! `spill/fuzz` drive): random bytes never panic, and encode -> decode round-trips.
//! Run: `cargo test --release -p kvnode-spill --test decoders`.

use kvnode_spill::SpillKey;
use kvnode_spill::disk::{
    BlockHeader, RecordKind, SECTOR, SummaryTrailer, Superblock, encode_summary,
};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = BlockHeader> {
    (
        any::<u64>(),
        any::<u128>(),
        any::<[u8; 32]>(),
        any::<u16>(),
        any::<u32>(),
        any::<u64>(),
        0u64..1 << 40,
        prop_oneof![
            4 => Just(RecordKind::Block),
            1 => Just(RecordKind::Delete),
            1 => Just(RecordKind::ClearNamespace),
            1 => Just(RecordKind::ClearAll),
        ],
    )
        .prop_map(
            |(seq, namespace, digest, segment, payload_len, payload_checksum, sector, kind)| {
                let payload_len = if kind.is_marker() { 0 } else { payload_len };
                BlockHeader {
                    kind,
                    seq,
                    region_gen: seq / 2,
                    file_offset: sector * SECTOR,
                    key: SpillKey {
                        namespace,
                        digest,
                        segment,
                    },
                    payload_len,
                    payload_checksum,
                }
            },
        )
}

proptest! {
    #[test]
    fn random_bytes_never_panic_any_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Superblock::decode(&bytes);
        let _ = BlockHeader::decode(&bytes);
        if let Ok(t) = SummaryTrailer::decode(&bytes) {
            let _ = t.decode_entries(&bytes);
        }
    }

    #[test]
    fn header_round_trips(h in header()) {
        prop_assert_eq!(BlockHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn header_with_any_byte_changed_is_rejected(h in header(), at in 0usize..104, x in 1u8..) {
        let mut b = h.encode();
        b[at] ^= x;
        prop_assert!(BlockHeader::decode(&b).is_err());
    }

    #[test]
    fn superblock_round_trips(file_index in any::<u32>(), uuid in any::<[u8; 16]>(), regions in 1u64..1000, rs in 4u64..10_000) {
        let sb = Superblock { block_align: 4096, file_size: SECTOR + regions * rs * SECTOR, region_size: rs * SECTOR, file_index, uuid };
        prop_assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
        let mut b = sb.encode();
        b[(file_index % 64) as usize] ^= 0x80;
        prop_assert!(Superblock::decode(&b).is_err());
    }

    #[test]
    fn summary_round_trips(hs in proptest::collection::vec(header(), 0..60), region_generation in any::<u64>()) {
        let body = SummaryTrailer::entries_len(hs.len() as u32) as usize;
        let mut out = vec![0u8; body + SECTOR as usize];
        encode_summary(region_generation, &hs, &mut out);
        let t = SummaryTrailer::decode(&out[body..]).unwrap();
        prop_assert_eq!(t.region_gen, region_generation);
        prop_assert_eq!(t.decode_entries(&out[..body]).unwrap(), hs);
    }
}
