//! Fuzzes the router hint parser: arbitrary text must parse or be refused, never panic, and
//! an accepted hint always has hashes and a dialable port.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(h) = kvnode_proto::hint::parse_hint(s)
    {
        assert!(!h.block_hashes.is_empty());
        assert_ne!(h.endpoint.port, 0);
        assert!(kvnode_proto::hint::Endpoint::parse(&h.endpoint.to_string()).is_ok());
    }
});
