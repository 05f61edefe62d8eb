//! A router's side of the daemon's router entry (docs/router-entry.md): a hints envelope sent
//! straight to a node's daemon at placement time, as a signed `POST /v1/act`.
//!
//! ```text
//! RouterEntry::act(RouterRequest) ─ JSON body, signed (kvnode_proto::router::sign) ─>
//!     one TCP connection, HTTP/1.1, `connection: close` ─> kvnode --router-listen
//!     <─ status line + headers + body: 200 -> RouterReply, else RouterRefusal's error
//! ```
//!
//! Blocking, std only: one connection per request (the daemon closes it after answering), no
//! pooling. Each request is signed at the sender's clock, which must be within
//! [`kvnode_proto::router::MAX_SKEW_MS`] of the daemon's.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvnode_proto::router::{
    ACT_PATH, HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, RouterRefusal, RouterReply,
    RouterRequest, key_id, sign,
};

/// Largest answer read (the daemon's replies are a few KiB per namespace).
const MAX_ANSWER: u64 = 16 << 20;

/// A failed router-entry request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterEntryError {
    /// Connecting, sending or reading failed.
    #[error(
        "router entry at {addr}: I/O failed: {source} (is the daemon serving `--router-listen` there?)"
    )]
    Io {
        /// The entry's address.
        addr: String,
        /// The failure.
        source: std::io::Error,
    },
    /// The daemon answered with a status other than 200.
    #[error("router entry refused the request (HTTP {status}): {error}")]
    Refused {
        /// HTTP status (401: signature, key id, clock or replay; 400: the body; 404: no
        /// namespace of the model).
        status: u16,
        /// The daemon's reason (`RouterRefusal::error`, or the body as received).
        error: String,
    },
    /// The answer is not HTTP/1.1 with a JSON reply this client understands.
    #[error("router entry answered something this client does not understand: {0}")]
    Protocol(String),
}

/// The router entry of one daemon, and the router key requests are signed with.
#[derive(Clone)]
pub struct RouterEntry {
    addr: String,
    key: [u8; 32],
    /// Connect, write and read timeout of each request. Default: 30 s.
    pub timeout: Duration,
}

impl std::fmt::Debug for RouterEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs; its id names it.
        f.debug_struct("RouterEntry")
            .field("addr", &self.addr)
            .field("key_id", &key_id(&self.key))
            .finish_non_exhaustive()
    }
}

impl RouterEntry {
    /// The entry at `addr` (`host:port`, or a `SocketAddr`), signing with `router_key`
    /// (`kvnode_proto::router::router_key` of a cluster key line).
    pub fn new(addr: impl std::fmt::Display, router_key: [u8; 32]) -> Self {
        Self {
            addr: addr.to_string(),
            key: router_key,
            timeout: Duration::from_secs(30),
        }
    }

    /// The entry's address, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sends `req` signed now; the daemon's reply, or why it refused.
    pub fn act(&self, req: &RouterRequest) -> Result<RouterReply, RouterEntryError> {
        let body = serde_json::to_vec(req)
            .map_err(|e| RouterEntryError::Protocol(format!("encoding the request: {e}")))?;
        let answer = self.post(&body).map_err(|source| RouterEntryError::Io {
            addr: self.addr.clone(),
            source,
        })?;
        let (status, body) = parse_answer(&answer)?;
        if status == 200 {
            return serde_json::from_slice(body)
                .map_err(|e| RouterEntryError::Protocol(format!("reply body: {e}")));
        }
        let error = serde_json::from_slice::<RouterRefusal>(body)
            .map_or_else(|_| String::from_utf8_lossy(body).into_owned(), |r| r.error);
        Err(RouterEntryError::Refused { status, error })
    }

    /// One signed POST of `body`; the raw answer (the daemon closes the connection).
    fn post(&self, body: &[u8]) -> std::io::Result<Vec<u8>> {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let head = format!(
            "POST {ACT_PATH} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n{HEADER_KEY_ID}: {}\r\n\
             {HEADER_TIMESTAMP}: {ts}\r\n{HEADER_SIGNATURE}: {}\r\n\r\n",
            self.addr,
            body.len(),
            key_id(&self.key),
            sign(&self.key, ts, "POST", ACT_PATH, body),
        );
        let mut s = connect(&self.addr, self.timeout)?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_write_timeout(Some(self.timeout))?;
        s.set_nodelay(true)?;
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        s.write_all(&req)?;
        let mut out = Vec::new();
        s.take(MAX_ANSWER).read_to_end(&mut out)?;
        Ok(out)
    }
}

fn connect(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{addr} resolves to nothing"))))
}

/// The status and body of an HTTP/1.1 answer read to its end: the body is `content-length`
/// bytes when the header is there, else everything after the headers.
fn parse_answer(a: &[u8]) -> Result<(u16, &[u8]), RouterEntryError> {
    let bad = |m: &str| RouterEntryError::Protocol(m.to_owned());
    let end = a
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&a[..end]).map_err(|_| bad("headers are not UTF-8"))?;
    let body = &a[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next(), parts.next());
    if !version.is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err(bad(&format!("status line {status_line:?}")));
    }
    let status: u16 = code
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(&format!("status line {status_line:?}")))?;
    let mut len = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("transfer-encoding") && value != "identity" {
            return Err(bad(&format!("transfer-encoding {value} (not supported)")));
        }
        if name.eq_ignore_ascii_case("content-length") {
            len = Some(
                value
                    .parse::<usize>()
                    .map_err(|_| bad(&format!("content-length {value:?}")))?,
            );
        }
    }
    match len {
        Some(n) if n > body.len() => {
            Err(bad(&format!("body cut short: {} of {n} bytes", body.len())))
        }
        Some(n) => Ok((status, &body[..n])),
        None => Ok((status, body)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvnode_proto::router::{router_key, signature_ok};
    use std::net::TcpListener;

    /// Serves one connection: reads the request to the end of its body, checks its signature
    /// with `key`, writes `answer`, closes. Returns the request's head.
    fn serve_once(
        answer: &'static [u8],
        key: [u8; 32],
    ) -> (String, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let (head, body) = loop {
                let n = s.read(&mut chunk).unwrap();
                assert!(n > 0, "client closed before its body");
                buf.extend_from_slice(&chunk[..n]);
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8(buf[..end].to_vec()).unwrap();
                let len: usize = header(&head, "content-length").parse().unwrap();
                if buf.len() >= end + 4 + len {
                    break (head, buf[end + 4..end + 4 + len].to_vec());
                }
            };
            let ts: u64 = header(&head, HEADER_TIMESTAMP).parse().unwrap();
            assert_eq!(header(&head, HEADER_KEY_ID), key_id(&key));
            let sig = header(&head, HEADER_SIGNATURE);
            assert!(signature_ok(&key, &sig, ts, "POST", ACT_PATH, &body));
            s.write_all(answer).unwrap();
            head
        });
        (addr, t)
    }

    fn header(head: &str, name: &str) -> String {
        head.split("\r\n")
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("no {name} in {head}"))
    }

    fn request() -> RouterRequest {
        RouterRequest {
            model: "m".into(),
            namespace: None,
            hints: serde_json::json!({"protocol_version": "1.0", "message_id": "r1", "actions": []}),
        }
    }

    #[test]
    fn a_signed_post_gets_the_reply_of_a_200_and_stops_at_content_length() {
        let key = router_key(b"router-client-test-key-0123456789");
        let (addr, t) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\ncontent-length: 35\r\n\r\n\
              {\"message_id\":\"r1\",\"namespaces\":[]}\ntrailing bytes",
            key,
        );
        let reply = RouterEntry::new(&addr, key).act(&request()).unwrap();
        assert_eq!(reply.message_id, "r1");
        assert!(reply.namespaces.is_empty());
        let head = t.join().unwrap();
        assert!(head.starts_with("POST /v1/act HTTP/1.1\r\n"), "{head}");
        assert_eq!(header(&head, "connection"), "close");
    }

    #[test]
    fn a_refusal_carries_its_status_and_the_daemons_error() {
        let key = router_key(b"router-client-test-key-0123456789");
        let (addr, t) = serve_once(
            b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 30\r\n\r\n{\"error\":\"replayed signature\"}",
            key,
        );
        let e = RouterEntry::new(&addr, key).act(&request()).unwrap_err();
        let RouterEntryError::Refused { status, error } = e else {
            panic!("{e:?}")
        };
        assert_eq!((status, error.as_str()), (401, "replayed signature"));
        t.join().unwrap();
    }

    #[test]
    fn answers_that_are_not_http_or_cut_short_are_protocol_errors() {
        for a in [
            &b"SSH-2.0-x\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK",
        ] {
            assert!(
                matches!(parse_answer(a), Err(RouterEntryError::Protocol(_))),
                "{}",
                String::from_utf8_lossy(a)
            );
        }
        assert_eq!(
            parse_answer(b"HTTP/1.1 503 Busy\r\n\r\nbusy").unwrap(),
            (503, &b"busy"[..])
        );
    }

    #[test]
    fn a_closed_port_is_an_io_error_naming_the_entry() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = RouterEntry::new(addr, [7; 32]).act(&request()).unwrap_err();
        assert!(
            matches!(&e, RouterEntryError::Io { addr: a, .. } if *a == addr.to_string()),
            "{e:?}"
        );
    }
}
