//! The clients `tests/tests/attack_caps.rs` runs as other uids: each connects to a daemon,
//! does one scripted thing and prints `key value` lines for the test to check.
//!
//! `caps_probe SOCKET hog CONNS REGIONS`   open up to CONNS connections, attach up to REGIONS
//!                                         memfd regions on each, print what was refused and
//!                                         how, print `ready 1`, then hold everything until
//!                                         stdin closes
//! `caps_probe SOCKET victim`              connect, register, put one block and get it back
//! `caps_probe SOCKET flood PORT SECS KEYS` hinted `Exists` of KEYS fresh keys (none held by
//!                                         the peer at PORT) in a loop for SECS seconds
//! `caps_probe SOCKET pulls PORT N KEYS LEN` N hinted gets of KEYS keys each (blocks the peer
//!                                         at PORT holds, put there by `put`); how each went
//! `caps_probe SOCKET put N LEN`           register and put blocks 0..N of LEN bytes
//!
//! Every client registers model `caps-model` with no salt, so one tenant's clients on two
//! daemons name the same namespace.

use std::collections::VecDeque;
use std::io::{BufRead, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kvnode_client::{Client, ClientError};
use kvnode_e2e::{block, hint, key, spec};
use kvnode_proto::client::{Op, Reply, Request, Response};
use kvnode_proto::frame::{FramePrefix, PREFIX_LEN, decode_header, encode_frame};
use kvnode_proto::pull::{FailCode, KeyOutcome, OpReport};
use kvnode_proto::{Key, PROTOCOL_VERSION};

fn out(k: &str, v: impl std::fmt::Display) {
    println!("{k} {v}");
}

/// Reads one reply (closing any descriptor that rides along), or why not.
fn recv(s: &UnixStream) -> Result<Reply, String> {
    let mut fds = VecDeque::new();
    let mut prefix = [0u8; PREFIX_LEN];
    let mut got = 0;
    while got < PREFIX_LEN {
        match kvnode_fdpass::recv_with_fds(s.as_raw_fd(), &mut prefix[got..], &mut fds, 1) {
            Ok(0) => return Err("closed".into()),
            Ok(n) => got += n,
            Err(e) => return Err(e.to_string()),
        }
    }
    let p = FramePrefix::decode(prefix).map_err(|e| e.to_string())?;
    let mut header = vec![0u8; p.header_len as usize];
    (&*s).read_exact(&mut header).map_err(|e| e.to_string())?;
    let r: Response = decode_header(&header).map_err(|e| e.to_string())?;
    Ok(r.reply)
}

/// A connection that completed `Hello`, or the error code (or I/O failure) that ended it.
fn hello(socket: &str) -> Result<UnixStream, String> {
    let s = UnixStream::connect(socket).map_err(|e| format!("io: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let req = Request {
        id: 1,
        op: Op::Hello {
            version: PROTOCOL_VERSION,
            client: "caps-probe".into(),
        },
    };
    (&s).write_all(&encode_frame(&req, 0).expect("frame"))
        .map_err(|e| format!("io: {e}"))?;
    match recv(&s) {
        Ok(Reply::HelloOk { .. }) => Ok(s),
        Ok(Reply::Error { code, .. }) => Err(format!("{code:?}")),
        Ok(other) => Err(format!("unexpected {other:?}")),
        Err(e) => Err(format!("io: {e}")),
    }
}

/// A 4 KiB memfd.
fn memfd() -> OwnedFd {
    // SAFETY: a valid NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"caps-region".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: fd was just created and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a valid descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
    fd
}

/// `AttachRegion` on `s`: Ok, or the error code / I/O failure.
fn attach(s: &UnixStream) -> Result<(), String> {
    let req = Request {
        id: 2,
        op: Op::AttachRegion { len: 4096 },
    };
    let frame = encode_frame(&req, 0).expect("frame");
    let fd = memfd();
    let sent = kvnode_fdpass::send_with_fd(s.as_raw_fd(), &frame, std::os::fd::AsFd::as_fd(&fd))
        .map_err(|e| format!("io: {e}"))?;
    (&*s)
        .write_all(&frame[sent..])
        .map_err(|e| format!("io: {e}"))?;
    match recv(s) {
        Ok(Reply::RegionAttached { .. }) => Ok(()),
        Ok(Reply::Error { code, .. }) => Err(format!("{code:?}")),
        Ok(other) => Err(format!("unexpected {other:?}")),
        Err(e) => Err(format!("io: {e}")),
    }
}

/// Counts of a hog's attempts: done, refused with a code (the first code kept), failed.
#[derive(Default)]
struct Tally {
    ok: u64,
    refused: u64,
    code: Option<String>,
    failed: u64,
}

impl Tally {
    fn add(&mut self, r: Result<(), String>) -> bool {
        match r {
            Ok(()) => self.ok += 1,
            Err(e) if e.starts_with("io:") || e.starts_with("unexpected") => self.failed += 1,
            Err(code) => {
                self.refused += 1;
                self.code.get_or_insert(code);
            }
        }
        self.failed < 8
    }

    fn print(&self, what: &str) {
        out(what, self.ok);
        out(&format!("{what}_refused"), self.refused);
        out(&format!("{what}_code"), self.code.as_deref().unwrap_or("-"));
        out(&format!("{what}_failed"), self.failed);
    }
}

fn hog(socket: &str, conns: u64, regions: u64) {
    let (mut c, mut r) = (Tally::default(), Tally::default());
    let mut held = Vec::new();
    for _ in 0..conns {
        match hello(socket) {
            Ok(s) => {
                c.add(Ok(()));
                for _ in 0..regions {
                    if !r.add(attach(&s)) {
                        break;
                    }
                }
                held.push(s);
            }
            Err(e) => {
                if !c.add(Err(e)) {
                    break;
                }
            }
        }
    }
    c.print("connections");
    r.print("regions");
    out("ready", 1);
    std::io::stdout().flush().expect("flush");
    // Hold every connection and region until the test closes stdin.
    let _ = std::io::stdin().lock().lines().count();
    drop(held);
}

fn register(c: &mut Client, len: u64) -> u32 {
    c.register(&spec("caps-model", len)).expect("register").ns
}

fn busy(r: &OpReport) -> bool {
    r.reason
        .as_ref()
        .is_some_and(|f| f.code == FailCode::PeerBusy)
        || r.results
            .iter()
            .any(|o| matches!(o, KeyOutcome::Failed(f) if f.code == FailCode::PeerBusy))
}

fn flood(c: &mut Client, port: u16, secs: u64, n: u64) {
    let ns = register(c, 4096);
    let t = Instant::now();
    let (mut floods, mut busy_n) = (0u64, 0u64);
    let mut next = 1u64 << 40;
    while t.elapsed() < Duration::from_secs(secs) {
        let keys: Vec<Key> = (next..next + n).map(key).collect();
        next += n;
        let (_, r) = c
            .exists_hinted(ns, &keys, Some(&hint(port, &keys)))
            .expect("exists");
        floods += 1;
        busy_n += u64::from(r.as_ref().is_some_and(busy));
    }
    out("floods", floods);
    out("flood_busy", busy_n);
}

fn pulls(c: &mut Client, port: u16, count: u64, per: u64, len: usize) {
    let ns = register(c, len as u64);
    let (mut pulled, mut busy_n, mut other) = (0u64, 0u64, 0u64);
    let mut why = String::from("-");
    for i in 0..count {
        let keys: Vec<Key> = (i * per..(i + 1) * per).map(key).collect();
        let (got, r) = c
            .get_hinted(ns, &keys, Some(&hint(port, &keys)), Some(5000))
            .expect("hinted get");
        let whole = got
            .iter()
            .enumerate()
            .all(|(j, g)| g.as_deref() == Some(block(i * per + j as u64, len).as_slice()));
        let r = r.expect("a hinted get reports its pull");
        if whole {
            pulled += 1;
        } else if busy(&r) {
            busy_n += 1;
            why = format!("{:?}", r.reason).replace('\n', " ");
        } else {
            other += 1;
            why = format!("{r:?}").replace('\n', " ");
        }
    }
    out("pulled", pulled);
    out("busy", busy_n);
    out("other", other);
    out("why", why);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let socket = args[1].as_str();
    let num = |i: usize| -> u64 { args[i].parse().expect("a number") };
    if args[2] == "hog" {
        hog(socket, num(3), num(4));
        return;
    }
    let mut c = match Client::connect(socket) {
        Ok(c) => c,
        Err(ClientError::Server { code, message }) => {
            out("connect_code", format!("{code:?}"));
            out("connect_error", message.replace('\n', " "));
            return;
        }
        Err(e) => {
            out("connect_error", e.to_string().replace('\n', " "));
            return;
        }
    };
    match args[2].as_str() {
        "victim" => {
            let ns = register(&mut c, 4096);
            let b = block(7, 4096);
            c.put(ns, &[key(7)], &[b.as_slice()]).expect("put");
            let got = c.get(ns, &[key(7)]).expect("get");
            out(
                "victim_ok",
                u8::from(got[0].as_deref() == Some(b.as_slice())),
            );
        }
        "flood" => flood(&mut c, num(3) as u16, num(4), num(5)),
        "pulls" => pulls(&mut c, num(3) as u16, num(4), num(5), num(6) as usize),
        "put" => {
            let (n, len) = (num(3), num(4) as usize);
            let ns = register(&mut c, len as u64);
            for i in 0..n {
                let b = block(i, len);
                c.put(ns, &[key(i)], &[b.as_slice()]).expect("put");
            }
            out("stored", n);
        }
        other => panic!("unknown command {other}"),
    }
}
