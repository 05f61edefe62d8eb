//! Peer-protocol frames for tests and the `peer-attacker` binary: plain and sealed frame I/O
//! over blocking sockets, a keyless fake source, and the scripted attacks (a keyless relay, a
//! reflector, a proof forger, an on-path proxy that alters, drops, reorders or records
//! frames). None of the attacks holds a cluster key.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use kvnode_engine::peer::auth::{source_proof, transcript};
use kvnode_engine::peer::transport::channel::{Channel, Side};
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, encode_frame};
use kvnode_proto::peer::{
    AEAD_TAG_LEN, HASH_LEN, NONCE_LEN, PEER_PROTOCOL_VERSION, PeerMsg, decode_peer,
};

/// Reads one whole frame (prefix, header, `tag` bytes, payload) as raw bytes.
pub fn read_frame(s: &mut impl Read, tag: usize) -> io::Result<Vec<u8>> {
    let mut p = [0u8; PREFIX_LEN];
    s.read_exact(&mut p)?;
    let prefix = FramePrefix::decode(p).map_err(|e| io::Error::other(e.to_string()))?;
    let rest = prefix.header_len as usize + tag + prefix.payload_len as usize;
    if rest > 300 << 20 {
        return Err(io::Error::other("frame too large"));
    }
    let mut f = p.to_vec();
    f.resize(PREFIX_LEN + rest, 0);
    s.read_exact(&mut f[PREFIX_LEN..])?;
    Ok(f)
}

/// Decodes a plain (handshake) frame.
pub fn decode_plain(f: &[u8]) -> Option<PeerMsg> {
    let p = FramePrefix::decode(f.get(..PREFIX_LEN)?.try_into().ok()?).ok()?;
    let h = f.get(PREFIX_LEN..PREFIX_LEN + p.header_len as usize)?;
    decode_peer(p, h).ok()
}

/// A plain frame.
pub fn plain(m: &PeerMsg, payload: &[u8]) -> Vec<u8> {
    let mut f = encode_frame(m, payload.len() as u64).expect("encode");
    f.extend_from_slice(payload);
    f
}

/// One peer connection seen from a test: plain until [`Wire::chan`] is set.
#[derive(Debug)]
pub struct Wire {
    /// The socket.
    pub s: TcpStream,
    /// The session, once the handshake set it.
    pub chan: Option<Channel>,
}

impl Wire {
    /// Wraps a socket (10 s read limit).
    pub fn new(s: TcpStream) -> Self {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Self { s, chan: None }
    }

    /// Sends a frame, sealed once the session is set.
    pub fn send(&mut self, m: &PeerMsg, payload: &[u8]) -> io::Result<()> {
        let mut f = match &mut self.chan {
            Some(c) => c
                .send
                .seal(m, payload.len() as u64)
                .map_err(|e| io::Error::other(e.to_string()))?,
            None => encode_frame(m, payload.len() as u64)
                .map_err(|e| io::Error::other(e.to_string()))?,
        };
        f.extend_from_slice(payload);
        self.s.write_all(&f)
    }

    /// Receives a frame header (opened once the session is set); a payload stays unread.
    pub fn recv(&mut self) -> io::Result<PeerMsg> {
        let mut p = [0u8; PREFIX_LEN];
        self.s.read_exact(&mut p)?;
        let prefix = FramePrefix::decode(p).map_err(|e| io::Error::other(e.to_string()))?;
        let mut h = vec![0u8; prefix.header_len as usize];
        self.s.read_exact(&mut h)?;
        match &mut self.chan {
            None => decode_peer(prefix, &h).map_err(|e| io::Error::other(e.to_string())),
            Some(c) => {
                let mut t = vec![0u8; c.recv.tag_len()];
                self.s.read_exact(&mut t)?;
                c.recv
                    .open(&p, &mut h, &t)
                    .map(|(m, _)| m)
                    .map_err(|e| io::Error::other(e.to_string()))
            }
        }
    }
}

/// A keyless fake source: accepts the destination's `Hello`, answers a correct keyless
/// `Challenge`, takes its `Auth`, sends a sealed `Ready`. Returns the sealed wire.
pub fn keyless_source_handshake(s: TcpStream) -> Wire {
    let mut w = Wire::new(s);
    let hello = w.recv().expect("Hello");
    assert!(
        matches!(&hello, PeerMsg::Hello { key_ids, .. } if key_ids.is_empty()),
        "{hello:?}"
    );
    let mut challenge = PeerMsg::Challenge {
        version: PEER_PROTOCOL_VERSION,
        node: "fake".into(),
        nonce: vec![7; NONCE_LEN],
        key_id: None,
        encrypt: false,
        proof: Vec::new(),
    };
    let th = transcript(&hello, &challenge).expect("transcript");
    let secret = kvnode_engine::peer::auth::secret(None, &th);
    if let PeerMsg::Challenge { proof, .. } = &mut challenge {
        *proof = source_proof(&secret).to_vec();
    }
    w.send(&challenge, &[]).unwrap();
    assert!(matches!(w.recv().expect("Auth"), PeerMsg::Auth { .. }));
    w.chan = Some(Channel::new(&secret, false, Side::Source));
    w.send(&PeerMsg::Ready, &[]).unwrap();
    w
}

/// A scripted keyless source's first steps: accepts one destination on `l`, completes the
/// handshake, declines UCX if asked (a scripted source speaks TCP only) and reads its first
/// `Pull`. Returns the sealed wire, the request id and the number of keys asked for.
pub fn accept_pull(l: &TcpListener) -> (Wire, u64, usize) {
    let (s, _) = l.accept().unwrap();
    let mut w = keyless_source_handshake(s);
    let mut first = w.recv().unwrap();
    if first == PeerMsg::UcxRequest {
        let reason = "scripted source: tcp only".to_owned();
        w.send(&PeerMsg::UcxDecline { reason }, &[]).unwrap();
        first = w.recv().unwrap();
    }
    let PeerMsg::Pull { req, keys, .. } = first else {
        panic!("no Pull: {first:?}")
    };
    (w, req, keys.len())
}

/// Sends `b` as key `idx` of request `req`, with its correct hash.
pub fn send_block(w: &mut Wire, req: u64, idx: u32, b: &[u8]) {
    let m = PeerMsg::Block {
        req,
        idx,
        len: b.len() as u32,
        hash: block_hash(b),
        seal: vec![],
        meta: None,
    };
    w.send(&m, b).unwrap();
}

/// Waits (at most 10 s) until `probe` returns true, polling every 5 ms; whether it did.
pub fn wait_until(mut probe: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if probe() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// The BLAKE3 hash a `Block` header carries for `b`.
pub fn block_hash(b: &[u8]) -> Vec<u8> {
    let h = blake3::hash(b).as_bytes().to_vec();
    assert_eq!(h.len(), HASH_LEN);
    h
}

/// What an attack saw, one `key=value` per line.
#[derive(Debug, Default)]
pub struct Report(pub Vec<String>);

impl Report {
    fn say(&mut self, k: &str, v: impl std::fmt::Display) {
        self.0.push(format!("{k}={v}"));
    }
}

fn kind(f: &io::Result<Vec<u8>>) -> String {
    match f {
        Err(e) => format!("closed({})", e.kind()),
        Ok(f) => match decode_plain(f) {
            Some(PeerMsg::Refused { reason }) => format!("Refused({reason})"),
            Some(m) => format!("{m:?}")
                .split([' ', '{'])
                .next()
                .unwrap_or("?")
                .to_owned(),
            None => "sealed".into(),
        },
    }
}

/// Tries to read a source's blocks after a handshake the attacker could not finish: sends
/// an `Auth` with `proof`, then a `Pull` (plain and again as garbage-sealed), and counts the
/// `Block` frames that come back.
fn try_to_read(a: &mut TcpStream, proof: Vec<u8>, r: &mut Report) {
    let _ = a.write_all(&plain(&PeerMsg::Auth { proof }, &[]));
    let answer = read_frame(a, 0);
    r.say("source_after_auth", kind(&answer));
    let pull = PeerMsg::Pull {
        req: 1,
        ns: kvnode_proto::NamespaceId(1),
        keys: vec![kvnode_proto::peer::PullKey(
            kvnode_proto::Digest([0; 32]),
            0,
        )],
        meta: false,
    };
    let mut sealed_looking = plain(&pull, &[]);
    sealed_looking.extend_from_slice(&[0u8; AEAD_TAG_LEN]);
    let _ = a.write_all(&plain(&pull, &[]));
    let _ = a.write_all(&sealed_looking);
    let mut blocks = 0;
    while let Ok(f) = read_frame(a, 0) {
        if FramePrefix::decode(f[..PREFIX_LEN].try_into().unwrap()).is_ok_and(|p| p.payload_len > 0)
        {
            blocks += 1;
        }
    }
    r.say("blocks_from_source", blocks);
}

/// A keyless relay: accepts one destination on `l`, opens its own connection to `to`,
/// passes the destination's `Hello` on (its `dialled` replaced by `rewrite`, if given) and the
/// answer back; if the destination sends `Auth`, passes it on too and pretends to be the
/// source (a `Ready`, then a block of its own bytes per pull). Then tries to read `to`'s
/// blocks.
pub fn relay(l: &TcpListener, to: &str, rewrite: Option<&str>) -> Report {
    let mut r = Report::default();
    let (mut b, _) = l.accept().expect("accept");
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut a = TcpStream::connect(to).expect("connect to the source");
    a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = read_frame(&mut b, 0).expect("Hello");
    let mut msg = decode_plain(&hello).expect("a plain Hello");
    if let (PeerMsg::Hello { dialled, .. }, Some(w)) = (&mut msg, rewrite) {
        w.clone_into(dialled);
    }
    a.write_all(&plain(&msg, &[])).unwrap();
    let challenge = read_frame(&mut a, 0);
    r.say("source_answer", kind(&challenge));
    let Ok(challenge) = challenge else {
        try_to_read(&mut a, vec![0; HASH_LEN], &mut r);
        return r;
    };
    let _ = b.write_all(&challenge);
    let auth = read_frame(&mut b, 0);
    r.say("destination_after_challenge", kind(&auth));
    let proof = match auth.as_ref().ok().and_then(|f| decode_plain(f)) {
        Some(PeerMsg::Auth { proof }) => {
            // Impersonate the source: a Ready and bytes of our choosing.
            let _ = b.write_all(&plain(&PeerMsg::Ready, &[]));
            let _ = b.write_all(&[0u8; AEAD_TAG_LEN]);
            proof
        }
        _ => vec![0; HASH_LEN],
    };
    try_to_read(&mut a, proof, &mut r);
    r
}

/// Connects to a keyed source claiming key `key_id`, answers its challenge with a forged
/// proof, then tries to pull.
pub fn forge(to: &str, dialled: &str, key_id: u64) -> Report {
    let mut r = Report::default();
    let mut a = TcpStream::connect(to).expect("connect");
    a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = PeerMsg::Hello {
        version: PEER_PROTOCOL_VERSION,
        node: "forger".into(),
        dialled: dialled.into(),
        nonce: vec![3; NONCE_LEN],
        key_ids: vec![key_id],
        encrypt: false,
    };
    a.write_all(&plain(&hello, &[])).unwrap();
    r.say("source_answer", kind(&read_frame(&mut a, 0)));
    try_to_read(&mut a, vec![0x42; HASH_LEN], &mut r);
    r
}

/// What an on-path proxy does to the first connection it carries (later ones pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tamper {
    /// Carry every byte unchanged.
    Pass,
    /// Flip one byte of the first block body from the source.
    FlipPayload,
    /// Flip one byte of the first sealed header from the source after `Ready`.
    FlipHeader,
    /// Drop the first sealed frame from the source after `Ready`.
    Drop,
    /// Swap the first two sealed frames from the source after `Ready`.
    Swap,
    /// Replay `Ready` in place of the next frame from the source.
    Replay,
    /// Flip one byte of the first sealed header from the destination (its first request):
    /// the other direction.
    FlipHeaderUp,
    /// Carry every answer after `Ready` one byte every 600 ms (a member that keeps a pull
    /// alive without ever finishing it: never silent for a whole io timeout).
    Trickle,
}

impl Tamper {
    /// Parses a mode name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pass" => Self::Pass,
            "flip-payload" => Self::FlipPayload,
            "flip-header" => Self::FlipHeader,
            "drop" => Self::Drop,
            "swap" => Self::Swap,
            "replay" => Self::Replay,
            "flip-header-up" => Self::FlipHeaderUp,
            "trickle" => Self::Trickle,
            _ => return None,
        })
    }
}

/// Frames of one direction: `plain` handshake frames first, then sealed ones, each with a
/// `tag` of [`AEAD_TAG_LEN`] bytes after its header (protocol 4, both session modes).
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    plain_frames: usize,
    tamper: Tamper,
    record: Option<&std::sync::Mutex<Vec<u8>>>,
) {
    let mut n = 0usize;
    let mut held: Option<Vec<u8>> = None;
    let mut ready: Option<Vec<u8>> = None;
    let mut done = tamper == Tamper::Pass;
    loop {
        let t = if n < plain_frames { 0 } else { AEAD_TAG_LEN };
        let Ok(mut f) = read_frame(&mut from, t) else {
            let _ = to.shutdown(std::net::Shutdown::Both);
            return;
        };
        n += 1;
        if let Some(r) = record {
            r.lock().unwrap().extend_from_slice(&f);
        }
        // Sealed frames from the source: #1 is Ready, #2.. the answers; from the destination
        // (two plain frames: Hello, Proof) #1.. its requests.
        let sealed = n.saturating_sub(plain_frames);
        if sealed == 1 {
            ready = Some(f.clone());
        }
        let first = if plain_frames == 2 { 1 } else { 2 };
        if !done && sealed >= first {
            match tamper {
                Tamper::FlipPayload => {
                    let p = FramePrefix::decode(f[..PREFIX_LEN].try_into().unwrap()).unwrap();
                    if p.payload_len > 0 {
                        let last = f.len() - 1;
                        f[last] ^= 0x01;
                        done = true;
                    }
                }
                Tamper::FlipHeader | Tamper::FlipHeaderUp => {
                    f[PREFIX_LEN + 1] ^= 0x01;
                    done = true;
                }
                Tamper::Drop => {
                    done = true;
                    continue;
                }
                Tamper::Swap => match held.take() {
                    None => {
                        held = Some(f);
                        continue;
                    }
                    Some(first) => {
                        let _ = to.write_all(&f);
                        f = first;
                        done = true;
                    }
                },
                Tamper::Replay => {
                    f = ready.clone().expect("Ready seen");
                    done = true;
                }
                Tamper::Trickle => {
                    for b in &f {
                        std::thread::sleep(std::time::Duration::from_millis(600));
                        if to.write_all(std::slice::from_ref(b)).is_err() {
                            return;
                        }
                    }
                    continue;
                }
                Tamper::Pass => {}
            }
        }
        if to.write_all(&f).is_err() {
            return;
        }
    }
}

/// A byte forwarder: copies `from` to `to` as it arrives, whatever the framing (so it
/// carries any protocol version), recording every byte into `record` when given.
fn forward(mut from: TcpStream, mut to: TcpStream, record: Option<&std::sync::Mutex<Vec<u8>>>) {
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(std::net::Shutdown::Both);
                return;
            }
            Ok(n) => n,
        };
        if let Some(r) = record {
            r.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// An on-path proxy: carries connections from `l` to `to` frame by frame, applying `tamper`
/// to the first connection (source to destination, or destination to source for
/// `FlipHeaderUp`), recording every byte the source sent
/// into `record` when given. Runs until the process ends.
pub fn proxy(
    l: &TcpListener,
    to: &str,
    tamper: Tamper,
    record: Option<&Arc<std::sync::Mutex<Vec<u8>>>>,
) -> ! {
    for (i, c) in l.incoming().enumerate() {
        let Ok(b) = c else { continue };
        let Ok(a) = TcpStream::connect(to) else {
            continue;
        };
        let t = if i == 0 { tamper } else { Tamper::Pass };
        let (down, up) = if t == Tamper::FlipHeaderUp {
            (Tamper::Pass, t)
        } else {
            (t, Tamper::Pass)
        };
        let (b2, a2) = (b.try_clone().unwrap(), a.try_clone().unwrap());
        std::thread::spawn(move || match up {
            Tamper::Pass => forward(b, a, None),
            u => pump(b, a, 2, u, None),
        });
        let rec = record.cloned();
        std::thread::spawn(move || match down {
            Tamper::Pass => forward(a2, b2, rec.as_deref()),
            d => pump(a2, b2, 1, d, rec.as_deref()),
        });
    }
    unreachable!("incoming() never ends")
}
