//! A keyless destination, for the attack on a keyless peer port (issue 25, item 3): any
//! local process can complete a keyless handshake, since its secret is the public transcript.

use std::io::{self, Read};
use std::net::TcpStream;

use kvnode_engine::peer::auth::{dest_proof, transcript};
use kvnode_engine::peer::transport::channel::{Channel, Side};
use kvnode_proto::peer::{NONCE_LEN, PEER_PROTOCOL_VERSION, PeerMsg};

use crate::peerwire::Wire;

/// A keyless destination, as any local process can be: dials `to` naming `dialled`,
/// completes the keyless handshake (no secret: the transcript is public), pulls `keys` of
/// namespace `ns` and returns how many blocks came back.
pub fn keyless_pull(
    to: &str,
    dialled: &str,
    ns: kvnode_proto::NamespaceId,
    keys: &[kvnode_proto::peer::PullKey],
) -> io::Result<usize> {
    let mut w = Wire::new(TcpStream::connect(to)?);
    let hello = PeerMsg::Hello {
        version: PEER_PROTOCOL_VERSION,
        node: "intruder".into(),
        dialled: dialled.into(),
        nonce: vec![5; NONCE_LEN],
        key_ids: Vec::new(),
        encrypt: false,
    };
    w.send(&hello, &[])?;
    let challenge = w.recv()?;
    let th = transcript(&hello, &challenge).map_err(|e| io::Error::other(e.to_string()))?;
    let secret = kvnode_engine::peer::auth::secret(None, &th);
    w.send(
        &PeerMsg::Auth {
            proof: dest_proof(&secret).to_vec(),
        },
        &[],
    )?;
    w.chan = Some(Channel::new(&secret, false, Side::Destination));
    match w.recv()? {
        PeerMsg::Ready => {}
        m => return Err(io::Error::other(format!("no Ready: {m:?}"))),
    }
    let pull = PeerMsg::Pull {
        req: 1,
        ns,
        keys: keys.to_vec(),
        meta: false,
    };
    w.send(&pull, &[])?;
    let mut blocks = 0;
    loop {
        match w.recv()? {
            PeerMsg::Block { len, .. } => {
                let mut b = vec![0u8; len as usize];
                w.s.read_exact(&mut b)?;
                blocks += 1;
            }
            PeerMsg::Done { .. } => return Ok(blocks),
            _ => {}
        }
    }
}
