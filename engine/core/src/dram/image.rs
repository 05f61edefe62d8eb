//! The DRAM tier's index as a byte image, for a takeover: the old daemon writes it, the new
//! one rebuilds its tier from it over the same arena memfd, so no block byte is copied.
//!
//! What travels: the slab size and count, the namespaces in handle order (re-registering
//! them in that order recreates the same slot classes), the class of every slab, and for
//! each committed block its slot, key, length, checksum, whether NVMe holds a copy, and its
//! router metadata (so the new daemon announces what it holds), and the blocks held by
//! `kv.retain` with the end of each hold (wall clock, so the hold keeps its end across the
//! gap; a slot that holds no restored block is ignored). Reservations, leases and
//! eviction order do not travel: the old daemon has no request in flight when it writes the
//! image (or, for a live image taken while it serves, the slots that change travel again in
//! the delta at the barrier: state/live.rs), and the new one starts with the blocks in slot
//! order.
//!
//! Format (little-endian): magic `KVNDRAM1`, u32 length + JSON header ([`ImageHeader`]), u64
//! block count, then per block: u64 slot, 16 B namespace id, 32 B digest, u16 segment, u64
//! length, u8 flags (1 = checksum, 2 = on NVMe, 4 = router metadata), u64 checksum,
//! and with flag 4: u64 hash, u8 + u64 parent, u32 block size, u32 token count + u32 tokens,
//! u8 + u32 length + salt bytes. Every value is checked again when the image is restored.

use std::sync::Arc;

use kvnode_proto::{BlockKey, Digest, NamespaceId, NamespaceSpec};
use serde::{Deserialize, Serialize};

use super::TierConfig;
use super::pool::{Resident, Slot, slot_parts};
use super::state::{State, key_hash};
use crate::policy::{BatchHint, EvictionPolicy, SlotId};
use crate::residency::{Announcer, RouterMeta};

const MAGIC: &[u8; 8] = b"KVNDRAM1";

/// The small part of the image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageHeader {
    /// Slab size of the tier that wrote it.
    pub slab_bytes: u64,
    /// Slab count.
    pub slabs: u32,
    /// Namespaces in handle order.
    pub namespaces: Vec<NamespaceSpec>,
    /// Slot bytes of each class, in class order (checked against the re-registration).
    pub classes: Vec<u64>,
    /// Class of each slab (`None`: unassigned).
    pub slab_class: Vec<Option<u32>>,
    /// Held blocks (`kv.retain`): slot and the hold's end in Unix milliseconds.
    #[serde(default)]
    pub retained: Vec<(SlotId, u64)>,
}

/// Why an image cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("DRAM image refused: {0}")]
pub struct ImageError(pub String);

pub(in crate::dram) fn bad(s: impl Into<String>) -> ImageError {
    ImageError(s.into())
}

pub(in crate::dram) struct Reader<'a> {
    pub(in crate::dram) b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(in crate::dram) fn take(&mut self, n: usize) -> Result<&'a [u8], ImageError> {
        if self.b.len() < n {
            return Err(bad("image truncated"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], ImageError> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u8(&mut self) -> Result<u8, ImageError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ImageError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    pub(in crate::dram) fn u32(&mut self) -> Result<u32, ImageError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    pub(in crate::dram) fn u64(&mut self) -> Result<u64, ImageError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
}

fn put_meta(out: &mut Vec<u8>, m: &RouterMeta) {
    out.extend_from_slice(&m.hash.to_le_bytes());
    out.push(u8::from(m.parent.is_some()));
    out.extend_from_slice(&m.parent.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&m.block_size.to_le_bytes());
    out.extend_from_slice(&(m.tokens.len() as u32).to_le_bytes());
    for t in &m.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    let salt = m.salt.as_deref().unwrap_or("");
    out.push(u8::from(m.salt.is_some()));
    out.extend_from_slice(&(salt.len() as u32).to_le_bytes());
    out.extend_from_slice(salt.as_bytes());
}

fn get_meta(r: &mut Reader<'_>) -> Result<RouterMeta, ImageError> {
    let hash = r.u64()?;
    let has_parent = r.u8()? != 0;
    let parent = r.u64()?;
    let block_size = r.u32()?;
    let n = r.u32()? as usize;
    if n > 1 << 20 {
        return Err(bad("router metadata with too many tokens"));
    }
    let tokens = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
    let has_salt = r.u8()? != 0;
    let sl = r.u32()? as usize;
    let salt = String::from_utf8(r.take(sl)?.to_vec()).map_err(|_| bad("salt not UTF-8"))?;
    Ok(RouterMeta {
        hash,
        parent: has_parent.then_some(parent),
        tokens,
        block_size,
        salt: has_salt.then_some(salt),
        charge: None,
    })
}

/// Encodes blocks announced on another tier (a takeover's NVMe announcements, which the
/// successor adopts): a count, then per block its key and router metadata, in the image's
/// own encoding.
pub fn encode_announced(list: &[(BlockKey, Arc<RouterMeta>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + list.len() * 96);
    out.extend_from_slice(&(list.len() as u64).to_le_bytes());
    for (k, m) in list {
        out.extend_from_slice(&k.ns.0.to_le_bytes());
        out.extend_from_slice(&k.digest.0);
        out.extend_from_slice(&k.segment.to_le_bytes());
        put_meta(&mut out, m);
    }
    out
}

/// Decodes [`encode_announced`]'s bytes; refused whole when malformed.
pub fn decode_announced(b: &[u8]) -> Result<Vec<(BlockKey, RouterMeta)>, ImageError> {
    let mut r = Reader { b };
    let n = r.u64()?;
    // Each entry takes more than 64 bytes: a count the bytes cannot hold is malformed.
    if n > (b.len() / 64) as u64 {
        return Err(bad(format!("{n} announced blocks in {} bytes", b.len())));
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let key = BlockKey {
            ns: NamespaceId(u128::from_le_bytes(r.arr()?)),
            digest: Digest(r.arr()?),
            segment: r.u16()?,
        };
        out.push((key, get_meta(&mut r)?));
    }
    if !r.b.is_empty() {
        return Err(bad("trailing bytes after the announced blocks"));
    }
    Ok(out)
}

/// Appends one block's record (the format in the module doc).
pub(in crate::dram) fn put_block(out: &mut Vec<u8>, slot: SlotId, ns: NamespaceId, r: &Resident) {
    let meta = r
        .residency
        .as_deref()
        .map(crate::residency::Residency::meta);
    out.extend_from_slice(&slot.to_le_bytes());
    out.extend_from_slice(&ns.0.to_le_bytes());
    out.extend_from_slice(&r.digest.0);
    out.extend_from_slice(&r.segment.to_le_bytes());
    out.extend_from_slice(&r.len.to_le_bytes());
    let flags = u8::from(r.fingerprint().is_some())
        | (u8::from(r.on_lower()) << 1)
        | (u8::from(meta.is_some()) << 2);
    out.push(flags);
    out.extend_from_slice(&r.fingerprint().unwrap_or(0).to_le_bytes());
    if let Some(m) = meta {
        put_meta(out, m);
    }
}

/// `magic`, the header, the block count and the blocks' records.
pub(in crate::dram) fn assemble(
    magic: [u8; 8],
    header: &ImageHeader,
    blocks: u64,
    body: &[u8],
) -> Result<Vec<u8>, ImageError> {
    let h = serde_json::to_vec(header).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::with_capacity(32 + h.len() + body.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&blocks.to_le_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// Reads `magic` and the header.
pub(in crate::dram) fn read_head(
    r: &mut Reader<'_>,
    magic: [u8; 8],
) -> Result<ImageHeader, ImageError> {
    if r.take(8)? != magic.as_slice() {
        return Err(bad("not a kvnode DRAM image (bad magic)"));
    }
    let hl = r.u32()? as usize;
    serde_json::from_slice(r.take(hl)?).map_err(|e| bad(format!("header: {e}")))
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl State {
    /// The image of the tier. Refused while a slot is reserved or a block is being moved
    /// (someone may still write into the arena).
    pub fn image(&self) -> Result<Vec<u8>, ImageError> {
        if self.totals.reserved > 0 || self.totals.in_flight > 0 {
            return Err(bad(format!(
                "{} slots reserved and {} demotions in flight: the tier is not quiescent",
                self.totals.reserved, self.totals.in_flight
            )));
        }
        let header = self.header(self.slabs.iter().map(|s| s.class).collect());
        let mut body = Vec::with_capacity(self.indexed_len() * 96);
        for (slot, r) in self.indexed() {
            if r.demoting() {
                return Err(bad("a block is being copied to NVMe: not quiescent"));
            }
            put_block(&mut body, slot, self.namespaces[r.ns as usize].id, r);
        }
        assemble(*MAGIC, &header, self.indexed_len() as u64, &body)
    }

    /// The image's header, with `slab_class` as the class of each slab.
    pub(in crate::dram) fn header(&self, slab_class: Vec<Option<u32>>) -> ImageHeader {
        ImageHeader {
            slab_bytes: self.slab_bytes,
            slabs: self.slabs.len() as u32,
            namespaces: self.namespaces.iter().map(|n| n.spec.clone()).collect(),
            classes: self.pools.iter().map(|p| p.slot_bytes).collect(),
            slab_class,
            retained: self
                .retention
                .ends()
                .into_iter()
                .map(|(slot, end)| (slot, unix_ms(end)))
                .collect(),
        }
    }

    /// A tier rebuilt from `image` over an arena of `cfg.capacity` bytes. Every slot, class
    /// and key is checked: an image that does not fit this configuration is refused whole.
    pub fn restore(
        cfg: &TierConfig,
        announcer: Arc<Announcer>,
        image: &[u8],
    ) -> Result<Self, ImageError> {
        let mut r = Reader { b: image };
        let header = read_head(&mut r, *MAGIC)?;
        let mut s = State::new(cfg, announcer);
        if header.slab_bytes != s.slab_bytes || header.slabs as usize != s.slabs.len() {
            return Err(bad(format!(
                "the image has {} slabs of {} bytes, this tier {} slabs of {} bytes: dram and slab_size must not change across a takeover",
                header.slabs,
                header.slab_bytes,
                s.slabs.len(),
                s.slab_bytes
            )));
        }
        for spec in &header.namespaces {
            s.register(spec)
                .map_err(|e| bad(format!("namespace {}: {e}", spec.model)))?;
        }
        let classes: Vec<u64> = s.pools.iter().map(|p| p.slot_bytes).collect();
        if classes != header.classes || header.slab_class.len() != s.slabs.len() {
            return Err(bad("slot classes differ from the image's"));
        }
        s.free_slabs.clear();
        for (i, c) in header.slab_class.iter().enumerate() {
            match c {
                Some(c) if (*c as usize) < s.pools.len() => s.assign_slab(i as u32, *c),
                Some(c) => return Err(bad(format!("slab {i} of unknown class {c}"))),
                None => s.free_slabs.push(i as u32),
            }
        }
        s.free_slabs.reverse();
        let n = r.u64()?;
        for _ in 0..n {
            s.restore_block(&mut r)?;
        }
        if !r.b.is_empty() {
            return Err(bad("trailing bytes after the last block"));
        }
        s.restore_holds(&header.retained);
        // Free lists: the slots no block took, lowest first.
        for c in 0..s.pools.len() {
            let slabs = s.pools[c].slabs.clone();
            let mut free = Vec::new();
            for &slab in slabs.iter().rev() {
                let slots = &s.slabs[slab as usize].slots;
                for i in (0..slots.len()).rev() {
                    if matches!(slots[i], Slot::Free) {
                        free.push(super::pool::slot_id(slab, i as u32));
                    }
                }
            }
            s.pools[c].free = free;
        }
        Ok(s)
    }

    /// Holds the blocks of `retained` (slot, end in Unix ms) until their ends.
    pub(in crate::dram) fn restore_holds(&mut self, retained: &[(SlotId, u64)]) {
        for &(slot, end) in retained {
            self.restore_hold(
                slot,
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(end),
            );
        }
    }

    pub(in crate::dram) fn restore_block(&mut self, r: &mut Reader<'_>) -> Result<(), ImageError> {
        let slot: SlotId = r.u64()?;
        let ns = NamespaceId(u128::from_le_bytes(r.arr()?));
        let digest = Digest(r.arr()?);
        let segment = r.u16()?;
        let len = r.u64()?;
        let flags = r.u8()?;
        let fingerprint = r.u64()?;
        let meta = if flags & 4 != 0 {
            Some(Arc::new(get_meta(r)?))
        } else {
            None
        };
        let key = BlockKey {
            ns,
            digest,
            segment,
        };
        let h = self
            .handle_of(ns)
            .ok_or_else(|| bad(format!("block of unknown namespace {ns}")))?;
        let (slab, idx) = slot_parts(slot);
        let class = self
            .slabs
            .get(slab as usize)
            .and_then(|s| s.class)
            .ok_or_else(|| bad(format!("block in unassigned slab {slab}")))?;
        let want = self.ns(h).ok().and_then(|e| e.class_of(segment));
        if want != Some(class) {
            return Err(bad(format!(
                "block of segment {segment} in slab {slab} of class {class}"
            )));
        }
        if len > self.pools[class as usize].slot_bytes {
            return Err(bad(format!("block of {len} bytes in a smaller slot")));
        }
        match self.slabs[slab as usize].slots.get(idx as usize) {
            Some(Slot::Free) => {}
            Some(_) => return Err(bad(format!("slot {slot:#x} listed twice"))),
            None => return Err(bad(format!("slot {slot:#x} outside its slab"))),
        }
        if self.find(h, &digest, segment).is_some() {
            return Err(bad("a key listed twice"));
        }
        let mut b = Resident::new(h, digest, segment, len);
        b.set_on_lower(flags & 2 != 0);
        if flags & 1 != 0 {
            b.set_fingerprint(fingerprint);
        }
        b.residency = self
            .announcer
            .reside(kvnode_events::Medium::CpuPinned, &key, meta.as_ref())
            .map(Box::new);
        *self.slot_mut(slot) = Slot::Block(b);
        self.index_insert(slot);
        self.mark_used(slot);
        self.pools[class as usize]
            .policy
            .insert(slot, key_hash(&key), BatchHint::SINGLE);
        self.totals.blocks += 1;
        self.totals.bytes += len;
        let st = self.ns_stats_mut(h);
        st.blocks += 1;
        st.bytes += len;
        Ok(())
    }
}
