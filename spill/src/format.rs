//! On-disk records (superblock, block header, region summary trailer): encoders and decoders.
//!
//! Byte layouts are specified in `docs/spill-format.md`; every integer is little-endian and every
//! record ends with an xxh3-64 checksum of the bytes before it. Decoders never panic: any input
//! either decodes to a record whose checksum matched or to a typed [`DecodeError`].

use crate::error::DecodeError;
use crate::key::SpillKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Alignment of every on-disk structure and of `O_DIRECT` transfers, in bytes.
pub const SECTOR: u64 = 4096;
/// Superblock magic, bytes 0..8 of every spill file.
pub const SUPER_MAGIC: [u8; 8] = *b"KVSPILL\0";
/// Block header magic, bytes 0..4 of every header sector.
pub const HEADER_MAGIC: [u8; 4] = *b"KVBK";
/// Region summary trailer magic, bytes 0..4 of a region's last sector.
pub const TRAILER_MAGIC: [u8; 4] = *b"KVSM";
/// The only format version this build reads and writes.
pub const FORMAT_VERSION: u16 = 1;
/// Encoded size of a [`Superblock`].
pub const SUPERBLOCK_LEN: usize = 64;
/// Encoded size of a [`BlockHeader`] (also the size of one summary entry).
pub const HEADER_LEN: usize = 104;
/// Encoded size of a [`SummaryTrailer`].
pub const TRAILER_LEN: usize = 40;

/// Rounds `n` up to the next multiple of [`SECTOR`].
pub const fn round_up(n: u64) -> u64 {
    n.div_ceil(SECTOR) * SECTOR
}

/// Payload checksum: xxh3-64 of the payload bytes seeded with the block's sequence number, so a
/// stale header next to a new payload (or the reverse) never verifies.
pub fn payload_checksum(payload: &[u8], seq: u64) -> u64 {
    xxh3_64_with_seed(payload, seq)
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn check_len(buf: &[u8], need: usize) -> Result<(), DecodeError> {
    if buf.len() < need {
        return Err(DecodeError::Truncated {
            need,
            got: buf.len(),
        });
    }
    Ok(())
}

fn check_sum(buf: &[u8], body: usize) -> Result<(), DecodeError> {
    let stored = le_u64(buf, body);
    let computed = xxh3_64(&buf[..body]);
    if stored != computed {
        return Err(DecodeError::Checksum { stored, computed });
    }
    Ok(())
}

/// File-level geometry and identity, stored in sector 0 of each spill file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// `O_DIRECT` alignment the file was created with (always 4096 in version 1).
    pub block_align: u32,
    /// Total file size in bytes, superblock sector included.
    pub file_size: u64,
    /// Size of each region in bytes (a multiple of `block_align`).
    pub region_size: u64,
    /// Position of this file in the tier's directory list when it was created.
    pub file_index: u32,
    /// Random identity chosen at creation; reported by recovery.
    pub uuid: [u8; 16],
}

impl Superblock {
    /// Encodes into `SUPERBLOCK_LEN` bytes.
    pub fn encode(&self) -> [u8; SUPERBLOCK_LEN] {
        let mut b = [0u8; SUPERBLOCK_LEN];
        b[0..8].copy_from_slice(&SUPER_MAGIC);
        b[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.block_align.to_le_bytes());
        b[16..24].copy_from_slice(&self.file_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.region_size.to_le_bytes());
        b[32..36].copy_from_slice(&self.file_index.to_le_bytes());
        b[40..56].copy_from_slice(&self.uuid);
        let sum = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes and validates a superblock (magic, version, checksum, geometry sanity).
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        check_len(buf, SUPERBLOCK_LEN)?;
        if buf[0..8] != SUPER_MAGIC {
            return Err(DecodeError::Magic { what: "superblock" });
        }
        let version = le_u16(buf, 8);
        if version != FORMAT_VERSION {
            return Err(DecodeError::Version {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        check_sum(buf, 56)?;
        let sb = Self {
            block_align: le_u32(buf, 12),
            file_size: le_u64(buf, 16),
            region_size: le_u64(buf, 24),
            file_index: le_u32(buf, 32),
            uuid: buf[40..56].try_into().unwrap_or([0; 16]),
        };
        let align = u64::from(sb.block_align);
        let sane = align == SECTOR
            && sb.region_size >= 4 * SECTOR
            && sb.region_size.is_multiple_of(align)
            && sb.file_size >= SECTOR + sb.region_size
            && le_u16(buf, 10) == 0
            && le_u32(buf, 36) == 0;
        if !sane {
            return Err(DecodeError::Geometry);
        }
        Ok(sb)
    }
}

/// What a header record stands for (its `flags` field). A marker has no payload; it ends, in
/// its own file, every block older than itself that it names, so a delete or a clear made
/// before a restart stays made after it (docs/spill-format.md, "Deletes and clears").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// A block: the header of a payload (flags 0).
    Block,
    /// Tombstone: the blocks of exactly this key written before it are deleted (flag bit 0).
    Delete,
    /// The blocks of this key's namespace written before it are deleted (flag bit 1).
    ClearNamespace,
    /// Every block written before it is deleted (flag bit 2).
    ClearAll,
}

impl RecordKind {
    const fn flags(self) -> u16 {
        match self {
            Self::Block => 0,
            Self::Delete => 1,
            Self::ClearNamespace => 2,
            Self::ClearAll => 4,
        }
    }

    const fn from_flags(flags: u16) -> Option<Self> {
        match flags {
            0 => Some(Self::Block),
            1 => Some(Self::Delete),
            2 => Some(Self::ClearNamespace),
            4 => Some(Self::ClearAll),
            _ => None,
        }
    }

    /// Whether this is a delete or clear marker rather than a block.
    pub const fn is_marker(self) -> bool {
        !matches!(self, Self::Block)
    }
}

/// Per-block header, stored at the start of the block's first sector and repeated verbatim as
/// an entry of its region's summary. Delete and clear markers use the same record with no
/// payload ([`RecordKind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    /// A block, or a delete or clear marker.
    pub kind: RecordKind,
    /// Tier-wide monotonically increasing write sequence; the highest copy of a key wins.
    pub seq: u64,
    /// Generation of the region the block was written into (also drawn from the sequence).
    pub region_gen: u64,
    /// Byte offset of this header in the file; a header found elsewhere is rejected.
    pub file_offset: u64,
    /// Block key.
    pub key: SpillKey,
    /// Payload length in bytes (the payload starts at the next sector).
    pub payload_len: u32,
    /// [`payload_checksum`] of the payload.
    pub payload_checksum: u64,
}

impl BlockHeader {
    /// Bytes the block occupies on disk: one header sector plus the payload rounded up.
    pub fn extent_len(&self) -> u64 {
        SECTOR + round_up(u64::from(self.payload_len))
    }

    /// A delete or clear marker (`kind` not [`RecordKind::Block`]) at `file_offset`: no
    /// payload, so it occupies one sector. `key` names what it ends: the key itself for a
    /// delete, its namespace for a namespace clear, nothing for a clear of everything.
    pub fn marker(
        kind: RecordKind,
        key: SpillKey,
        seq: u64,
        region_gen: u64,
        file_offset: u64,
    ) -> Self {
        debug_assert!(kind.is_marker());
        Self {
            kind,
            seq,
            region_gen,
            file_offset,
            key,
            payload_len: 0,
            payload_checksum: payload_checksum(&[], seq),
        }
    }

    /// Encodes into `HEADER_LEN` bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&HEADER_MAGIC);
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.flags().to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.region_gen.to_le_bytes());
        b[24..32].copy_from_slice(&self.file_offset.to_le_bytes());
        b[32..48].copy_from_slice(&self.key.namespace.to_le_bytes());
        b[48..80].copy_from_slice(&self.key.digest);
        b[80..82].copy_from_slice(&self.key.segment.to_le_bytes());
        b[84..88].copy_from_slice(&self.payload_len.to_le_bytes());
        b[88..96].copy_from_slice(&self.payload_checksum.to_le_bytes());
        let sum = xxh3_64(&b[..96]);
        b[96..104].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes and validates a block header (magic, version, checksum, known flags, reserved
    /// bytes zero, no payload behind a marker).
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        check_len(buf, HEADER_LEN)?;
        if buf[0..4] != HEADER_MAGIC {
            return Err(DecodeError::Magic {
                what: "block header",
            });
        }
        let version = le_u16(buf, 4);
        if version != FORMAT_VERSION {
            return Err(DecodeError::Version {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        check_sum(buf, 96)?;
        let Some(kind) = RecordKind::from_flags(le_u16(buf, 6)) else {
            return Err(DecodeError::Reserved);
        };
        if le_u16(buf, 82) != 0 {
            return Err(DecodeError::Reserved);
        }
        let mut ns = [0u8; 16];
        ns.copy_from_slice(&buf[32..48]);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&buf[48..80]);
        let h = Self {
            kind,
            seq: le_u64(buf, 8),
            region_gen: le_u64(buf, 16),
            file_offset: le_u64(buf, 24),
            key: SpillKey {
                namespace: u128::from_le_bytes(ns),
                digest,
                segment: le_u16(buf, 80),
            },
            payload_len: le_u32(buf, 84),
            payload_checksum: le_u64(buf, 88),
        };
        let marker_with_payload = kind.is_marker() && h.payload_len != 0;
        if !h.file_offset.is_multiple_of(SECTOR) || h.region_gen > h.seq || marker_with_payload {
            return Err(DecodeError::Geometry);
        }
        Ok(h)
    }
}

/// Last sector of a sealed region: describes the summary entries stored just before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SummaryTrailer {
    /// Generation of the region this summary describes.
    pub region_gen: u64,
    /// Number of [`HEADER_LEN`]-byte entries in the summary.
    pub entry_count: u32,
    /// xxh3-64 of the concatenated entries.
    pub entries_checksum: u64,
}

impl SummaryTrailer {
    /// Bytes the summary entries occupy, rounded up to whole sectors.
    pub fn entries_len(entry_count: u32) -> u64 {
        round_up(u64::from(entry_count) * HEADER_LEN as u64)
    }

    /// Encodes into `TRAILER_LEN` bytes.
    pub fn encode(&self) -> [u8; TRAILER_LEN] {
        let mut b = [0u8; TRAILER_LEN];
        b[0..4].copy_from_slice(&TRAILER_MAGIC);
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.region_gen.to_le_bytes());
        b[16..20].copy_from_slice(&self.entry_count.to_le_bytes());
        b[24..32].copy_from_slice(&self.entries_checksum.to_le_bytes());
        let sum = xxh3_64(&b[..32]);
        b[32..40].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes and validates a trailer.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        check_len(buf, TRAILER_LEN)?;
        if buf[0..4] != TRAILER_MAGIC {
            return Err(DecodeError::Magic {
                what: "summary trailer",
            });
        }
        let version = le_u16(buf, 4);
        if version != FORMAT_VERSION {
            return Err(DecodeError::Version {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        check_sum(buf, 32)?;
        if le_u16(buf, 6) != 0 || le_u32(buf, 20) != 0 {
            return Err(DecodeError::Reserved);
        }
        Ok(Self {
            region_gen: le_u64(buf, 8),
            entry_count: le_u32(buf, 16),
            entries_checksum: le_u64(buf, 24),
        })
    }

    /// Decodes the summary entries that this trailer describes from `entries` (at least
    /// `entry_count * HEADER_LEN` bytes), checking the entries checksum and each header.
    pub fn decode_entries(&self, entries: &[u8]) -> Result<Vec<BlockHeader>, DecodeError> {
        let len = self.entry_count as usize * HEADER_LEN;
        check_len(entries, len)?;
        let body = &entries[..len];
        let computed = xxh3_64(body);
        if computed != self.entries_checksum {
            return Err(DecodeError::Checksum {
                stored: self.entries_checksum,
                computed,
            });
        }
        body.chunks_exact(HEADER_LEN)
            .map(BlockHeader::decode)
            .collect()
    }
}

/// Encodes a summary (entries then trailer) into a buffer of exactly
/// `entries_len(n) + SECTOR` bytes, the trailer in the last sector.
pub fn encode_summary(region_gen: u64, entries: &[BlockHeader], out: &mut [u8]) {
    let count = entries.len() as u32;
    let body_len = SummaryTrailer::entries_len(count) as usize;
    debug_assert_eq!(out.len(), body_len + SECTOR as usize);
    out.fill(0);
    for (i, h) in entries.iter().enumerate() {
        out[i * HEADER_LEN..(i + 1) * HEADER_LEN].copy_from_slice(&h.encode());
    }
    let entries_checksum = xxh3_64(&out[..entries.len() * HEADER_LEN]);
    let t = SummaryTrailer {
        region_gen,
        entry_count: count,
        entries_checksum,
    };
    out[body_len..body_len + TRAILER_LEN].copy_from_slice(&t.encode());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> BlockHeader {
        BlockHeader {
            kind: RecordKind::Block,
            seq: 9,
            region_gen: 3,
            file_offset: 8192,
            key: SpillKey {
                namespace: 7,
                digest: [5; 32],
                segment: 2,
            },
            payload_len: 5000,
            payload_checksum: 42,
        }
    }

    #[test]
    fn header_extent_covers_header_sector_and_rounded_payload() {
        assert_eq!(header().extent_len(), 4096 + 8192);
    }

    #[test]
    fn flipping_any_header_byte_is_rejected() {
        let enc = header().encode();
        for i in 0..HEADER_LEN {
            let mut b = enc;
            b[i] ^= 0x40;
            assert!(BlockHeader::decode(&b).is_err(), "byte {i} flip accepted");
        }
    }

    #[test]
    fn markers_round_trip_and_unknown_flags_or_a_payload_behind_a_marker_are_rejected() {
        for kind in [
            RecordKind::Delete,
            RecordKind::ClearNamespace,
            RecordKind::ClearAll,
        ] {
            let h = header();
            let m = BlockHeader::marker(kind, h.key, h.seq, h.region_gen, h.file_offset);
            assert_eq!(m.extent_len(), SECTOR);
            assert_eq!(BlockHeader::decode(&m.encode()), Ok(m));
            let with_payload = BlockHeader {
                payload_len: 1,
                ..m
            };
            assert_eq!(
                BlockHeader::decode(&with_payload.encode()),
                Err(DecodeError::Geometry)
            );
        }
        for flags in [3u16, 8, 0x8000] {
            let mut b = header().encode();
            b[6..8].copy_from_slice(&flags.to_le_bytes());
            let sum = xxh3_64(&b[..96]);
            b[96..104].copy_from_slice(&sum.to_le_bytes());
            assert_eq!(BlockHeader::decode(&b), Err(DecodeError::Reserved));
        }
    }

    #[test]
    fn summary_round_trips_and_rejects_damaged_entries() {
        let hs = vec![header(); 50];
        let mut out = vec![0u8; SummaryTrailer::entries_len(50) as usize + SECTOR as usize];
        encode_summary(3, &hs, &mut out);
        let body = SummaryTrailer::entries_len(50) as usize;
        let t = SummaryTrailer::decode(&out[body..]).unwrap();
        assert_eq!(t.decode_entries(&out[..body]).unwrap(), hs);
        out[100] ^= 1;
        assert!(t.decode_entries(&out[..body]).is_err());
    }
}
