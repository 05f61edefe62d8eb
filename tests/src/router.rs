//! A router's side of the router entry (docs/router-entry.md): signed `POST /v1/act` over a
//! plain TCP connection, as any HTTP client would send it.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvnode_proto::router::{
    ACT_PATH, HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, key_id, router_key, sign,
};

/// The router key of a cluster key (one line of the key file).
pub fn key_of(cluster_key: &str) -> [u8; 32] {
    router_key(cluster_key.as_bytes())
}

/// This machine's clock in Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The signing headers of `body` under `key` at `ts_ms`.
pub fn signed_headers(key: &[u8; 32], ts_ms: u64, body: &[u8]) -> Vec<(String, String)> {
    vec![
        (HEADER_KEY_ID.to_owned(), key_id(key)),
        (HEADER_TIMESTAMP.to_owned(), ts_ms.to_string()),
        (
            HEADER_SIGNATURE.to_owned(),
            sign(key, ts_ms, "POST", ACT_PATH, body),
        ),
    ]
}

/// POSTs `body` with `headers` to the entry on `127.0.0.1:port`: (status, body).
pub fn post(port: u16, headers: &[(String, String)], body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the router entry");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!(
        "POST {ACT_PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        let _ = write!(req, "{k}: {v}\r\n");
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// POSTs `body` signed with `key` now.
pub fn post_signed(port: u16, key: &[u8; 32], body: &[u8]) -> (u16, String) {
    post(port, &signed_headers(key, now_ms(), body), body)
}
