//! Fuzzes the block header decoder: never panics; whatever decodes re-encodes identically.
#![no_main]

use kvnode_spill::disk::{BlockHeader, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = BlockHeader::decode(data) {
        assert_eq!(h.encode()[..], data[..HEADER_LEN]);
    }
});
