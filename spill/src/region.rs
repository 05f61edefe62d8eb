//! Per-file region allocator: append into the open region, seal full ones, reclaim FIFO.
//!
//! Life of a region: `Free -> Open -> Draining (full, writes in flight) -> Sealing (fdatasync,
//! then summary write) -> Sealed -> (reclaimed, oldest first) -> Open`. Only `Sealed` regions
//! are reclaimed, so a region is never overwritten while its own writes are in flight.
//!
//! Reclaim follows the order regions were opened in, not the order their seals completed:
//! two seals in flight may finish in either order, and reclaiming a newer region before an
//! older one would both break FIFO eviction and let a delete marker (newer) be overwritten
//! while the block it ended (older) is still on disk. When the oldest region is still
//! draining or sealing, allocation waits for it.

use crate::format::{BlockHeader, SECTOR, SummaryTrailer};
use crate::recovery::RegionScan;
use std::collections::VecDeque;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Free,
    Open,
    Draining,
    Sealing,
    Sealed,
}

#[derive(Debug)]
pub(crate) struct Region {
    pub generation: u64,
    pub state: State,
    pub entries: Vec<BlockHeader>,
    /// Bytes used from the region start.
    fill: u64,
    /// Block writes in flight.
    pending: u32,
}

/// Where a new block goes, and what making room for it did.
#[derive(Debug)]
pub(crate) struct Placement {
    pub region: u32,
    pub generation: u64,
    pub file_offset: u64,
    /// Region that became full and has no writes in flight: seal it now.
    pub seal: Option<u32>,
    /// Entries of the region reclaimed to make room (FIFO eviction).
    pub reclaimed: Vec<BlockHeader>,
}

/// Outcome of an allocation.
#[derive(Debug)]
pub(crate) enum Alloc {
    Placed(Placement),
    /// Every region is open, draining or sealing: retry after a seal completes.
    Busy {
        seal: Option<u32>,
    },
}

#[derive(Debug)]
pub(crate) struct Regions {
    size: u64,
    list: Vec<Region>,
    free: VecDeque<u32>,
    /// Regions holding data (open, draining, sealing or sealed), oldest generation first.
    used: VecDeque<u32>,
    open: Option<u32>,
}

impl Regions {
    /// Builds the allocator from recovery results: regions with entries are sealed (oldest
    /// generation reclaimed first), the others free.
    pub fn from_scan(size: u64, scans: Vec<RegionScan>) -> Self {
        let mut list = Vec::with_capacity(scans.len());
        let mut free = VecDeque::new();
        let mut sealed: Vec<(u64, u32)> = Vec::new();
        for (i, s) in scans.into_iter().enumerate() {
            let state = if s.entries.is_empty() {
                State::Free
            } else {
                State::Sealed
            };
            match state {
                State::Free => free.push_back(i as u32),
                _ => sealed.push((s.generation, i as u32)),
            }
            list.push(Region {
                generation: s.generation,
                state,
                entries: s.entries,
                fill: 0,
                pending: 0,
            });
        }
        sealed.sort_unstable();
        Self {
            size,
            list,
            free,
            used: sealed.into_iter().map(|(_, i)| i).collect(),
            open: None,
        }
    }

    fn start(&self, r: u32) -> u64 {
        SECTOR + u64::from(r) * self.size
    }

    fn fits(&self, r: u32, extent: u64) -> bool {
        let g = &self.list[r as usize];
        let n = g.entries.len() as u32 + 1;
        g.fill + extent + SummaryTrailer::entries_len(n) + SECTOR <= self.size
    }

    /// Finds room for a block of `extent` bytes; `next_gen` numbers a newly opened region.
    pub fn alloc(&mut self, extent: u64, next_gen: impl FnOnce() -> u64) -> Alloc {
        let mut seal = None;
        if let Some(o) = self.open {
            if self.fits(o, extent) {
                return Alloc::Placed(self.place(o, extent, seal, Vec::new()));
            }
            self.open = None;
            let g = &mut self.list[o as usize];
            g.state = State::Draining;
            if g.pending == 0 {
                g.state = State::Sealing;
                seal = Some(o);
            }
        }
        let (r, reclaimed) = if let Some(r) = self.free.pop_front() {
            (r, Vec::new())
        } else if let Some(r) = self
            .used
            .front()
            .copied()
            .filter(|&r| self.list[r as usize].state == State::Sealed)
        {
            self.used.pop_front();
            (r, std::mem::take(&mut self.list[r as usize].entries))
        } else {
            return Alloc::Busy { seal };
        };
        let g = &mut self.list[r as usize];
        g.generation = next_gen();
        g.state = State::Open;
        g.fill = 0;
        g.entries.clear();
        self.open = Some(r);
        self.used.push_back(r);
        Alloc::Placed(self.place(r, extent, seal, reclaimed))
    }

    fn place(
        &mut self,
        r: u32,
        extent: u64,
        seal: Option<u32>,
        reclaimed: Vec<BlockHeader>,
    ) -> Placement {
        let file_offset = self.start(r) + self.list[r as usize].fill;
        let g = &mut self.list[r as usize];
        g.fill += extent;
        Placement {
            region: r,
            generation: g.generation,
            file_offset,
            seal,
            reclaimed,
        }
    }

    /// Records the header of a block placed in `r` (a write is now in flight there).
    pub fn push_entry(&mut self, r: u32, h: BlockHeader) {
        let g = &mut self.list[r as usize];
        g.entries.push(h);
        g.pending += 1;
    }

    /// A block write into `r` finished; returns `r` if it must be sealed now.
    pub fn write_done(&mut self, r: u32) -> Option<u32> {
        let g = &mut self.list[r as usize];
        g.pending -= 1;
        (g.state == State::Draining && g.pending == 0).then(|| {
            g.state = State::Sealing;
            r
        })
    }

    /// Closes the open region for shutdown; returns it if it must be sealed.
    pub fn close_open(&mut self) -> Option<u32> {
        let o = self.open.take()?;
        let g = &mut self.list[o as usize];
        if g.entries.is_empty() {
            g.state = State::Free;
            // The open region is the newest one.
            debug_assert_eq!(self.used.back(), Some(&o));
            self.used.pop_back();
            self.free.push_back(o);
            return None;
        }
        g.state = State::Sealing;
        Some(o)
    }

    /// The summary of `r` was written: it may now be reclaimed, in its turn.
    pub fn seal_done(&mut self, r: u32) {
        self.list[r as usize].state = State::Sealed;
    }

    /// Whether `(r, generation)` still names live data (the region was not reclaimed since).
    pub fn is_current(&self, r: u32, generation: u64) -> bool {
        self.list
            .get(r as usize)
            .is_some_and(|g| g.generation == generation && g.state != State::Free)
    }

    pub fn region(&self, r: u32) -> &Region {
        &self.list[r as usize]
    }

    /// Byte offset in the file where `r` ends.
    pub fn end(&self, r: u32) -> u64 {
        self.start(r) + self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::SpillKey;

    fn hdr(off: u64, generation: u64) -> BlockHeader {
        BlockHeader {
            kind: crate::format::RecordKind::Block,
            seq: generation + 1,
            region_gen: generation,
            file_offset: off,
            key: SpillKey {
                namespace: 1,
                digest: [0; 32],
                segment: 0,
            },
            payload_len: 4096,
            payload_checksum: 0,
        }
    }

    fn empty(n: usize, size: u64) -> Regions {
        Regions::from_scan(size, (0..n).map(|_| RegionScan::default()).collect())
    }

    #[test]
    fn full_region_is_sealed_then_reclaimed_oldest_first() {
        let size = 7 * SECTOR;
        let mut rs = empty(2, size);
        let mut generation = 0;
        let mut next = || {
            generation += 1;
            generation
        };
        let mut placed = Vec::new();
        // Each region fits two 2-sector blocks (4 sectors) plus summary and trailer.
        for _ in 0..4 {
            let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
                panic!("busy")
            };
            rs.push_entry(p.region, hdr(p.file_offset, p.generation));
            if let Some(s) = rs.write_done(p.region) {
                rs.seal_done(s);
            }
            if let Some(s) = p.seal {
                rs.seal_done(s);
            }
            placed.push(p);
        }
        assert_eq!(
            placed.iter().map(|p| p.region).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
            panic!("busy")
        };
        assert_eq!(p.region, 0);
        assert_eq!(p.reclaimed.len(), 2);
        assert!(!rs.is_current(0, placed[0].generation));
    }

    /// Seals finish in any order (fdatasync and summary writes of two regions race in the
    /// kernel). Reclaim still takes the oldest region, and waits for it when it is not sealed.
    #[test]
    fn a_newer_region_sealed_first_is_not_reclaimed_before_the_older_one() {
        let mut rs = empty(3, 7 * SECTOR);
        let mut generation = 0;
        let mut next = || {
            generation += 1;
            generation
        };
        let mut seals = Vec::new();
        // Fill all three regions (two blocks each); every write completes, seals stay pending.
        for _ in 0..6 {
            let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
                panic!("busy")
            };
            rs.push_entry(p.region, hdr(p.file_offset, p.generation));
            seals.extend(rs.write_done(p.region));
            seals.extend(p.seal);
        }
        assert_eq!(seals, [0, 1]);
        // Region 1's seal completes before region 0's.
        rs.seal_done(1);
        let Alloc::Busy { seal } = rs.alloc(2 * SECTOR, &mut next) else {
            panic!("reclaimed a region newer than one still sealing")
        };
        assert_eq!(seal, Some(2));
        rs.seal_done(0);
        let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
            panic!("busy after the oldest region sealed")
        };
        assert_eq!(p.region, 0);
        assert_eq!(p.reclaimed.len(), 2);
        let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
            panic!("busy")
        };
        assert_eq!(
            p.region, 0,
            "the reclaimed region has room for a second block"
        );
    }

    #[test]
    fn allocation_waits_while_the_only_other_region_is_draining() {
        let mut rs = empty(2, 7 * SECTOR);
        let mut generation = 0;
        let mut next = || {
            generation += 1;
            generation
        };
        for _ in 0..4 {
            let Alloc::Placed(p) = rs.alloc(2 * SECTOR, &mut next) else {
                panic!("busy")
            };
            rs.push_entry(p.region, hdr(p.file_offset, p.generation));
        }
        assert!(matches!(
            rs.alloc(2 * SECTOR, &mut next),
            Alloc::Busy { seal: None }
        ));
    }
}
