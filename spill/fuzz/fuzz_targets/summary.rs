//! Fuzzes the region summary decoder (trailer then entries): never panics.
#![no_main]

use kvnode_spill::disk::{SummaryTrailer, TRAILER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < TRAILER_LEN {
        return;
    }
    let (trailer, entries) = data.split_at(TRAILER_LEN);
    if let Ok(t) = SummaryTrailer::decode(trailer) {
        let _ = t.decode_entries(entries);
    }
});
