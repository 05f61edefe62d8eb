//! A raw protocol connection: frames written and read by hand, for tests that send what
//! the client library never would.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use kvnode_proto::PROTOCOL_VERSION;
use kvnode_proto::client::{ErrorCode, Op, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, decode_header, encode_frame};

use crate::Daemon;

/// One connection to a daemon's client socket.
#[derive(Debug)]
pub struct Raw(pub UnixStream);

impl Raw {
    /// Connects (reads time out after 10 s); with `hello`, completes the handshake.
    pub fn connect(d: &Daemon, hello: bool) -> Self {
        let s = UnixStream::connect(d.socket()).expect("connect to the daemon socket");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("set read timeout");
        let mut r = Raw(s);
        if hello {
            r.send(
                &Request {
                    id: 1,
                    op: Op::Hello {
                        version: PROTOCOL_VERSION,
                        client: "raw".into(),
                    },
                },
                &[],
            );
            let reply = r.recv().expect("Hello answered").reply;
            assert!(matches!(reply, Reply::HelloOk { .. }), "{reply:?}");
        }
        r
    }

    /// Writes one frame: `msg` as the header, then `payload`.
    pub fn send<T: serde::Serialize>(&mut self, msg: &T, payload: &[u8]) {
        let f = encode_frame(msg, payload.len() as u64).expect("encode frame");
        self.0.write_all(&f).expect("write frame");
        self.0.write_all(payload).expect("write payload");
    }

    /// Next reply, or `None` if the daemon closed the connection.
    pub fn recv(&mut self) -> Option<Response> {
        let mut p = [0u8; 8];
        self.0.read_exact(&mut p).ok()?;
        let p = FramePrefix::decode(p).expect("frame prefix");
        let mut h = vec![0u8; p.header_len as usize];
        self.0.read_exact(&mut h).expect("frame header");
        let mut payload = vec![0u8; p.payload_len as usize];
        self.0.read_exact(&mut payload).expect("frame payload");
        Some(decode_header(&h).expect("reply header"))
    }

    /// The next reply must be an error of `code`; returns its message.
    pub fn expect_error(&mut self, code: ErrorCode) -> String {
        match self.recv().map(|r| r.reply) {
            Some(Reply::Error { code: c, message }) if c == code => message,
            other => panic!("expected {code:?} error, got {other:?}"),
        }
    }

    /// Whether the daemon closed the connection.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}
