//! A router's residency snapshot request on a daemon's replay socket (docs/events.md,
//! "Snapshot"), as a real ZMQ DEALER sends it.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The snapshot request's body.
pub const SNAPSHOT_REQUEST: &[u8] = b"kvnode:snapshot";
/// The seq frame of every snapshot batch.
pub const SNAPSHOT_SEQ: i64 = -2;

/// Asks `endpoint` for a snapshot: its batches, and the seq S it is consistent with.
pub async fn snapshot_of(endpoint: &str) -> (Vec<Bytes>, u64) {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = vec![Bytes::new(), Bytes::from_static(SNAPSHOT_REQUEST)];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("the snapshot answers")
            .unwrap();
        assert_eq!(m.len(), 3, "[\"\", seq, payload]");
        let seq = i64::from_be_bytes(m.get(1).unwrap()[..].try_into().unwrap());
        let payload = m.get(2).unwrap().clone();
        if seq == -1 {
            let s = payload[..].try_into().expect("the end marker carries S");
            return (out, u64::from_be_bytes(s));
        }
        assert_eq!(seq, SNAPSHOT_SEQ, "a snapshot batch's seq frame");
        out.push(payload);
    }
}
