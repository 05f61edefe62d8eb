//! Fuzzes the superblock decoder: never panics; whatever decodes re-encodes identically.
#![no_main]

use kvnode_spill::disk::{SUPERBLOCK_LEN, Superblock};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(sb) = Superblock::decode(data) {
        assert_eq!(sb.encode()[..], data[..SUPERBLOCK_LEN]);
    }
});
