//! Fuzzes the peer frame decoder: arbitrary bytes must decode or fail, never panic, and a
//! decoded frame never claims more bytes than were given.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((_, len))) = kvnode_proto::peer::decode_peer_frame(data) {
        assert!(len <= data.len());
    }
});
