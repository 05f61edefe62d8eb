//! The hash and block MAC a source sends with each block: remembered per slot, or computed
//! from one snapshot of the bytes (ahead of the send on other threads: [`super::ahead`]).

use std::ops::Deref;

use kvnode_proto::NamespaceId;
use kvnode_proto::peer::PullKey;

use crate::peer::Peers;
use crate::peer::hashes::{HashCache, SlotId, Sums, fingerprint};
use crate::store::Lease;
use kvnode_blockmac::{BlockMac, MacState};

/// The block's hash (and, with `mac`, its tag under that key): remembered, or computed now
/// from one snapshot of its bytes and remembered. `None` when its bytes no longer match the
/// fingerprint its slot kept from the first time (changed under a lease).
pub fn block_hash(
    cache: &HashCache,
    ns: NamespaceId,
    k: PullKey,
    b: &Lease,
    mac: Option<&BlockMac>,
) -> Option<Sums> {
    if let Some(c) = remembered(cache, ns, k, b, mac) {
        return Some(c);
    }
    // Nothing remembered, or no tag under this key yet: both again, from the same bytes.
    let kept = b.fingerprint();
    let sums = sums_of(b.bytes(), mac);
    let f = fingerprint(&sums.hash);
    match kept {
        Some(k) if k != f => return None,
        Some(_) => {}
        None => b.remember_checksum(f),
    }
    cache.put(slot_of(ns, k, b, f), sums);
    Some(sums)
}

/// Hash and tag of `bytes`, both over one private copy of each piece, so a client writing
/// through the shared arena meanwhile cannot make them disagree.
fn sums_of(bytes: &[u8], mac: Option<&BlockMac>) -> Sums {
    let Some(m) = mac else {
        return Sums {
            hash: *blake3::hash(bytes).as_bytes(),
            tag: None,
        };
    };
    let mut h = blake3::Hasher::new();
    let mut st = MacState::default();
    let mut copy = vec![0u8; SNAPSHOT.min(bytes.len())];
    for piece in bytes.chunks(SNAPSHOT) {
        let c = &mut copy[..piece.len()];
        c.copy_from_slice(piece);
        h.update(c);
        m.update(&mut st, c);
    }
    Sums {
        hash: *h.finalize().as_bytes(),
        tag: Some((m.id(), m.finish(st))),
    }
}

/// Bytes hashed from one copy (a multiple of 16, as the MAC's pieces must be).
const SNAPSHOT: usize = 128 << 10;

/// The lease and sums of a leased block, or `None` (answered `Miss`) when its bytes
/// changed after it was hashed.
pub(super) fn hashed<B: Deref<Target = Lease>>(
    p: &Peers,
    ns: NamespaceId,
    k: PullKey,
    b: B,
    mac: Option<&BlockMac>,
) -> Option<(B, Sums)> {
    let h = block_hash(&p.hashes, ns, k, &b, mac);
    settled(p, b, h)
}

/// `b` with its sums, or `None` (answered `Miss`, counted and logged) when it has none
/// because its bytes changed after they were first hashed.
pub(in crate::peer) fn settled<B: Deref<Target = Lease>>(
    p: &Peers,
    b: B,
    h: Option<Sums>,
) -> Option<(B, Sums)> {
    if h.is_none() {
        p.counters
            .changed_blocks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            len = b.len(),
            "a block's bytes changed after it was hashed (written through a client mapping?): answered Miss"
        );
    }
    h.map(|h| (b, h))
}

/// What `cache` already holds for `b` (with a tag under `mac`'s key, when given).
pub(in crate::peer) fn remembered(
    cache: &HashCache,
    ns: NamespaceId,
    k: PullKey,
    b: &Lease,
    mac: Option<&BlockMac>,
) -> Option<Sums> {
    let f = b.fingerprint()?;
    let c = cache.get(&slot_of(ns, k, b, f))?;
    match mac {
        Some(m) if c.tag_for(m.id()).is_none() => None,
        _ => Some(c),
    }
}

fn slot_of(ns: NamespaceId, k: PullKey, b: &Lease, fingerprint: u64) -> SlotId {
    SlotId {
        ns,
        digest: k.0,
        segment: k.1,
        offset: b.extent().offset,
        len: b.len(),
        fingerprint,
    }
}

/// Threads a request's not-yet-hashed blocks are spread over: one in four, at most 8 (a
/// first send of freshly offloaded blocks is otherwise held to one core's BLAKE3 rate).
/// Read once: `available_parallelism` reads cgroup files on every call (it was 5 % of a
/// source's CPU when called per request).
pub(super) fn hash_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 8)))
}
