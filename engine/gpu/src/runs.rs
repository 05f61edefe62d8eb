//! Grouping the pages of a layer-wise onload into runs that step evenly on both sides (device
//! page start and arena block each an arithmetic progression), so that one piece of one layer
//! over a run is ONE pitched copy.
//!
//! Why not just consecutive pages: the daemon's slots step evenly only inside a slab (a 64 MiB
//! slab holds 7 blocks of 9 MiB, then 1 MiB is left), so runs of consecutive pages break every
//! 7 pages; but the blocks with the same slot index in consecutive slabs step evenly (one slab)
//! while their pages step by 7. Picking, from each start, the step that gives the longest run
//! finds those: 7 runs per registration piece instead of one per slab.
//!
//! Bounds: a run's second page is looked for among the next [`WINDOW`] pages in device order, so
//! grouping n pages costs O(n · WINDOW) lookups plus the length of the runs walked. Every host
//! row of a run lies in one registration piece ([`HostPieces`]): a copy whose host range spans
//! two `cuMemHostRegister` ranges is not a copy from one pinned allocation.

use std::collections::HashMap;

/// How many pages after a run's first (in device order) are tried as its second.
pub const WINDOW: usize = 64;

/// The arena's CUDA registrations: `piece`-byte ranges from `base` (0: one unbounded range).
/// A pitched copy's host rows must all lie in one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPieces {
    /// Host address of the first piece.
    pub base: usize,
    /// Bytes per piece; 0 for one range without end.
    pub piece: u64,
}

impl HostPieces {
    /// One unbounded range (no registration to respect).
    pub const NONE: Self = Self { base: 0, piece: 0 };

    /// The piece holding host address `a`.
    fn of(self, a: usize) -> u64 {
        match self.piece {
            0 => 0,
            p => (a.saturating_sub(self.base) as u64) / p,
        }
    }

    /// The piece holding all of `[a, a + len)`, if one does.
    pub(crate) fn holding(self, a: usize, len: u64) -> Option<u64> {
        let first = self.of(a);
        (self.of(a + len.max(1) as usize - 1) == first).then_some(first)
    }
}

/// Pages at `dev + i·dev_step` on the device and `host + i·host_step` in the arena, `i < rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Device offset of the first page (its page start).
    pub dev: u64,
    /// Host address of the first page's block.
    pub host: usize,
    /// Pages, at least 1.
    pub rows: u64,
    /// Device bytes from one page to the next (0 for one page).
    pub dev_step: u64,
    /// Host bytes from one page to the next (0 for one page).
    pub host_step: u64,
}

/// Covers `pages` (`(device page start, host address of its block)`, device starts distinct)
/// with runs, each page in exactly one. Steps are at least `min_step` on both sides (so the
/// rows of a piece up to `min_step` bytes never overlap) and each run's blocks of `block` bytes
/// lie in one piece of `pieces`. Greedy: from the first page not yet covered (device order), the
/// longest run over the candidates for its second page; ties go to the nearer candidate.
pub fn runs(pages: &[(u64, usize)], min_step: u64, block: u64, pieces: HostPieces) -> Vec<Run> {
    let mut order = pages.to_vec();
    order.sort_unstable();
    let at: HashMap<u64, usize> = order
        .iter()
        .enumerate()
        .map(|(i, &(d, _))| (d, i))
        .collect();
    debug_assert_eq!(at.len(), order.len(), "device page starts must be distinct");
    let mut used = vec![false; order.len()];
    let mut out = Vec::new();
    let g = Grouping {
        order: &order,
        at: &at,
        min_step,
        block,
        pieces,
    };
    for s in 0..order.len() {
        if used[s] {
            continue;
        }
        let run = g.longest_from(s, &used);
        let mut p = s;
        for i in 0..run.rows {
            if i > 0 {
                p = at[&(run.dev + i * run.dev_step)];
            }
            used[p] = true;
        }
        out.push(run);
    }
    out
}

/// The pages in device order and where each device start sits in it.
struct Grouping<'a> {
    order: &'a [(u64, usize)],
    at: &'a HashMap<u64, usize>,
    min_step: u64,
    block: u64,
    pieces: HostPieces,
}

impl Grouping<'_> {
    /// The longest run of uncovered pages starting at `order[s]`.
    fn longest_from(&self, s: usize, used: &[bool]) -> Run {
        let (d0, h0) = self.order[s];
        let mut best = Run {
            dev: d0,
            host: h0,
            rows: 1,
            dev_step: 0,
            host_step: 0,
        };
        let Some(piece) = self.pieces.holding(h0, self.block) else {
            return best;
        };
        let end = self.order.len().min(s + 1 + WINDOW);
        for c in (s + 1..end).filter(|&c| !used[c]) {
            let (d1, h1) = self.order[c];
            let (dd, Some(dh)) = (d1 - d0, (h1 as u64).checked_sub(h0 as u64)) else {
                continue;
            };
            if dd < self.min_step || dh < self.min_step {
                continue;
            }
            let rows = self.walk(d0, h0, dd, dh, piece, used);
            if rows > best.rows {
                best = Run {
                    rows,
                    dev_step: dd,
                    host_step: dh,
                    ..best
                };
            }
        }
        best
    }

    /// How many uncovered pages follow `(d0, h0)` at steps `(dd, dh)` (counting it) in `piece`.
    fn walk(&self, d0: u64, h0: usize, dd: u64, dh: u64, piece: u64, used: &[bool]) -> u64 {
        let mut rows = 1u64;
        loop {
            let next = dd
                .checked_mul(rows)
                .and_then(|x| x.checked_add(d0))
                .zip(dh.checked_mul(rows).and_then(|x| x.checked_add(h0 as u64)));
            let Some((d, h)) = next else {
                return rows;
            };
            let fits = self.at.get(&d).is_some_and(|&p| {
                !used[p]
                    && self.order[p].1 as u64 == h
                    && self.pieces.holding(h as usize, self.block) == Some(piece)
            });
            if !fits {
                return rows;
            }
            rows += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// `n` pages with consecutive ids (step `stride` on the device) in an arena whose `slab`s hold
    /// `slab / block` blocks each, allocated slab by slab.
    fn slabbed(n: u64, stride: u64, block: u64, slab: u64) -> Vec<(u64, usize)> {
        let per = slab / block;
        (0..n)
            .map(|j| (j * stride, ((j / per) * slab + (j % per) * block) as usize))
            .collect()
    }

    fn covered(pages: &[(u64, usize)], rs: &[Run]) -> Vec<(u64, usize)> {
        let mut got: Vec<(u64, usize)> = rs
            .iter()
            .flat_map(|r| {
                (0..r.rows)
                    .map(move |i| (r.dev + i * r.dev_step, r.host + (i * r.host_step) as usize))
            })
            .collect();
        got.sort_unstable();
        let mut want = pages.to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "every page in exactly one run");
        got
    }

    #[test]
    fn same_slot_index_across_slabs_is_one_run_per_registration_piece() {
        // The 32k-token prefix: 512 pages of 9 MiB, 7 per 64 MiB slab, 1 GiB pieces.
        let pages = slabbed(512, 128 << 10, 9 * MIB, 64 * MIB);
        let pieces = HostPieces {
            base: 0,
            piece: 1 << 30,
        };
        let rs = runs(&pages, 128 << 10, 9 * MIB, pieces);
        covered(&pages, &rs);
        // 4 whole pieces of 16 slabs (7 runs of 16 pages each) and 64 pages in the fifth.
        assert_eq!(rs.len(), 4 * 7 + 7);
        assert_eq!(rs[0].rows, 16);
        assert_eq!(
            (rs[0].dev_step, rs[0].host_step),
            (7 * (128 << 10), 64 * MIB)
        );
        // Without pieces: one run per slot index.
        let rs = runs(&pages, 128 << 10, 9 * MIB, HostPieces::NONE);
        covered(&pages, &rs);
        assert_eq!(rs.len(), 7);
        assert_eq!(rs.iter().map(|r| r.rows).max(), Some(74));
    }

    #[test]
    fn evenly_spaced_pages_are_one_run_and_scattered_ones_one_each() {
        let pages: Vec<(u64, usize)> = (0..100).map(|j| (j * 4096, (j * 8192) as usize)).collect();
        let rs = runs(&pages, 4096, 4096, HostPieces::NONE);
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].rows, 100);
        // Host order reversed against device order: no step is positive on both sides.
        let rev: Vec<(u64, usize)> = (0..10)
            .map(|j| (j * 4096, ((10 - j) * 8192) as usize))
            .collect();
        let rs = runs(&rev, 4096, 4096, HostPieces::NONE);
        covered(&rev, &rs);
        assert!(rs.iter().all(|r| r.rows == 1));
    }

    #[test]
    fn a_step_under_the_row_width_is_never_taken() {
        // Blocks 1 KiB apart but rows of 2 KiB: pitched rows would overlap.
        let pages: Vec<(u64, usize)> = (0..8).map(|j| (j * 4096, (j * 1024) as usize)).collect();
        let rs = runs(&pages, 2048, 1024, HostPieces::NONE);
        covered(&pages, &rs);
        assert!(rs.iter().all(|r| r.rows == 1 || r.host_step >= 2048));
    }

    #[test]
    fn a_run_never_spans_two_registration_pieces() {
        let pages: Vec<(u64, usize)> = (0..64)
            .map(|j| (j * 4096, 1000 + (j * 4096) as usize))
            .collect();
        let pieces = HostPieces {
            base: 1000,
            piece: 16 * 4096,
        };
        let rs = runs(&pages, 4096, 4096, pieces);
        covered(&pages, &rs);
        assert_eq!(rs.len(), 4);
        assert!(rs.iter().all(|r| r.rows == 16));
        // A block straddling a piece boundary is a run of its own.
        let odd = [(0u64, 1000 + 4096 * 16 - 100), (4096, 1000 + 4096 * 17)];
        let rs = runs(&odd, 4096, 4096, pieces);
        assert_eq!(rs.len(), 2);
    }
}
