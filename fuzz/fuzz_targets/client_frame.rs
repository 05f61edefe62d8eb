//! Fuzzes the daemon's view of a client frame: prefix, then the msgpack request header.
#![no_main]

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, decode_header};
use kvnode_proto::{Request, client::Response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= PREFIX_LEN {
        let _ = FramePrefix::decode(data[..PREFIX_LEN].try_into().unwrap());
    }
    let _ = decode_header::<Request>(data);
    let _ = decode_header::<Response>(data);
});
