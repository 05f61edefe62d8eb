//! Start-up recovery: rebuild each region's block list from summaries or by scanning.
//!
//! A sealed region (valid trailer whose generation matches the region's first header) is
//! read from its summary without touching payloads: its blocks were fdatasynced before the
//! summary was written. Any other region with a valid first header is scanned sector by
//! sector, and only blocks whose header *and* payload checksum verify are kept; the scanned
//! region is then sealed so the next start-up is fast.

use crate::buf::AlignedBuf;
use crate::error::SpillError;
use crate::file::{SpillFile, read_full};
use crate::format::{
    BlockHeader, HEADER_MAGIC, RecordKind, SECTOR, SummaryTrailer, encode_summary, payload_checksum,
};
use crate::key::SpillKey;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;

/// What recovery found in one region.
#[derive(Debug, Default)]
pub(crate) struct RegionScan {
    pub generation: u64,
    pub entries: Vec<BlockHeader>,
}

/// What recovery found in one file.
#[derive(Debug, Default)]
pub(crate) struct FileScan {
    /// One entry per region; empty regions have no entries.
    pub regions: Vec<RegionScan>,
    /// Torn or corrupt blocks skipped.
    pub skipped: u64,
    /// Regions read from their summary.
    pub summaries: u64,
    /// Regions scanned sector by sector.
    pub scanned: u64,
}

impl FileScan {
    /// Every record found, blocks and markers.
    pub fn records(&self) -> impl Iterator<Item = &BlockHeader> {
        self.regions.iter().flat_map(|r| &r.entries)
    }
}

/// The delete and clear markers of one file, and which of that file's blocks they end: a
/// block is gone if a marker naming it (its key, its namespace, or everything) was written
/// after it, that is with a higher sequence number.
///
/// A marker is resolved against its own file only. Regions of a file are reclaimed oldest
/// first, so every block a marker ends is reclaimed before the marker itself: a marker never
/// disappears while a block it ended is still on disk. (Across files, reclaim order says
/// nothing, which is why a delete writes its marker to every file.)
#[derive(Debug, Default)]
pub(crate) struct MarkSet {
    keys: HashMap<SpillKey, u64>,
    namespaces: HashMap<u128, u64>,
    all: u64,
}

impl MarkSet {
    /// Collects the markers among `records`.
    pub fn of<'a>(records: impl Iterator<Item = &'a BlockHeader>) -> Self {
        let mut m = Self::default();
        for h in records {
            let newest = |at: &mut u64| *at = (*at).max(h.seq);
            match h.kind {
                RecordKind::Block => {}
                RecordKind::Delete => newest(m.keys.entry(h.key).or_default()),
                RecordKind::ClearNamespace => {
                    newest(m.namespaces.entry(h.key.namespace).or_default());
                }
                RecordKind::ClearAll => newest(&mut m.all),
            }
        }
        m
    }

    /// Whether block `h` of this file was deleted or cleared after it was written.
    pub fn ended(&self, h: &BlockHeader) -> bool {
        let after = |at: Option<&u64>| at.is_some_and(|&s| s > h.seq);
        self.all > h.seq
            || after(self.namespaces.get(&h.key.namespace))
            || after(self.keys.get(&h.key))
    }
}

const WINDOW: usize = 8 << 20;

struct Window {
    buf: AlignedBuf,
    start: u64,
    valid: usize,
}

impl Window {
    /// Makes `[off, off+len)` available and returns it.
    fn get(&mut self, f: &SpillFile, off: u64, len: usize) -> Result<&[u8], SpillError> {
        let have = off >= self.start && off + len as u64 <= self.start + self.valid as u64;
        if !have {
            let want = len.max(WINDOW);
            if self.buf.capacity() < want {
                self.buf = AlignedBuf::zeroed(want);
            }
            self.buf.set_len(want);
            read_full(&f.file, &mut self.buf, off)
                .map_err(|e| SpillError::io("reading spill file at recovery", &f.path, e))?;
            self.start = off;
            self.valid = want;
        }
        let at = (off - self.start) as usize;
        Ok(&self.buf[at..at + len])
    }
}

fn read_sector(f: &SpillFile, buf: &mut AlignedBuf, off: u64) -> Result<(), SpillError> {
    read_full(&f.file, buf, off)
        .map_err(|e| SpillError::io("reading spill file at recovery", &f.path, e))
}

/// Reads a sealed region's summary; `None` when it is missing, stale or damaged.
fn read_summary(
    f: &SpillFile,
    start: u64,
    size: u64,
    generation: u64,
    sector: &mut AlignedBuf,
) -> Result<Option<Vec<BlockHeader>>, SpillError> {
    read_sector(f, sector, start + size - SECTOR)?;
    let Ok(t) = SummaryTrailer::decode(sector) else {
        return Ok(None);
    };
    let body = SummaryTrailer::entries_len(t.entry_count);
    if t.region_gen != generation || body + 2 * SECTOR > size {
        return Ok(None);
    }
    let mut entries = AlignedBuf::zeroed(body as usize);
    read_full(&f.file, &mut entries, start + size - SECTOR - body)
        .map_err(|e| SpillError::io("reading region summary", &f.path, e))?;
    let Ok(hs) = t.decode_entries(&entries) else {
        return Ok(None);
    };
    let limit = start + size - SECTOR - body;
    let ok = hs.iter().all(|h| {
        h.region_gen == generation
            && h.file_offset >= start
            && h.file_offset + h.extent_len() <= limit
    });
    Ok(ok.then_some(hs))
}

/// Scans a region sector by sector, keeping blocks whose header and payload verify.
fn scan_region(
    f: &SpillFile,
    start: u64,
    size: u64,
    generation: u64,
    skipped: &mut u64,
) -> Result<Vec<BlockHeader>, SpillError> {
    let mut w = Window {
        buf: AlignedBuf::zeroed(SECTOR as usize),
        start: 0,
        valid: 0,
    };
    let limit = start + size - SECTOR;
    let mut out = Vec::new();
    let mut pos = start;
    while pos + SECTOR <= limit {
        let sector = w.get(f, pos, SECTOR as usize)?;
        let magic = sector[..4] == HEADER_MAGIC;
        match BlockHeader::decode(sector) {
            Ok(h)
                if h.region_gen == generation
                    && h.file_offset == pos
                    && pos + h.extent_len() <= limit =>
            {
                let len = h.payload_len as usize;
                let data = w.get(f, pos, h.extent_len() as usize)?;
                let payload = &data[SECTOR as usize..SECTOR as usize + len];
                if payload_checksum(payload, h.seq) == h.payload_checksum {
                    out.push(h);
                    pos += h.extent_len();
                    continue;
                }
                *skipped += 1;
            }
            Ok(h) if h.region_gen != generation => {}
            Ok(_) => *skipped += 1,
            Err(_) if magic => *skipped += 1,
            Err(_) => {}
        }
        pos += SECTOR;
    }
    Ok(out)
}

/// Writes a summary for `entries` and fdatasyncs (used to seal a scanned region).
pub(crate) fn seal_now(
    f: &SpillFile,
    start: u64,
    size: u64,
    generation: u64,
    entries: &[BlockHeader],
) -> Result<(), SpillError> {
    let body = SummaryTrailer::entries_len(entries.len() as u32);
    let mut buf = AlignedBuf::zeroed((body + SECTOR) as usize);
    encode_summary(generation, entries, &mut buf);
    f.file
        .write_all_at(&buf, start + size - SECTOR - body)
        .and_then(|()| f.file.sync_data())
        .map_err(|e| SpillError::io("sealing a recovered region", &f.path, e))
}

/// Rebuilds the block lists of every region of `f`.
pub(crate) fn scan_file(f: &SpillFile, regions: u64, size: u64) -> Result<FileScan, SpillError> {
    let mut scan = FileScan::default();
    let mut sector = AlignedBuf::zeroed(SECTOR as usize);
    for r in 0..regions {
        let start = SECTOR + r * size;
        read_sector(f, &mut sector, start)?;
        let first = match BlockHeader::decode(&sector) {
            Ok(h) if h.file_offset == start => h,
            Ok(_) => {
                scan.regions.push(RegionScan::default());
                continue;
            }
            Err(_) => {
                if sector[..4] == HEADER_MAGIC {
                    scan.skipped += 1;
                }
                scan.regions.push(RegionScan::default());
                continue;
            }
        };
        let generation = first.region_gen;
        if let Some(entries) = read_summary(f, start, size, generation, &mut sector)? {
            scan.summaries += 1;
            scan.regions.push(RegionScan {
                generation,
                entries,
            });
            continue;
        }
        scan.scanned += 1;
        let entries = scan_region(f, start, size, generation, &mut scan.skipped)?;
        if !entries.is_empty() {
            seal_now(f, start, size, generation, &entries)?;
        }
        scan.regions.push(RegionScan {
            generation,
            entries,
        });
    }
    Ok(scan)
}
