//! Layer-wise copy plans: every page's layer 0, then every page's layer 1, …, so an engine can
//! run layer 0 of its forward pass while later layers are still on the way.
//!
//! A block is `layers` equal runs in model order (layer `l` = block bytes
//! `[l*B/layers, (l+1)*B/layers)`); its pieces in a GPU page follow the layout's objects
//! (a layer-first page's layer is its K and V objects of that layer, a page-first page's layer
//! is one contiguous run). Every page has the same pieces, shifted by its page start and its
//! block's address, so the pages are grouped once into runs that step evenly on both sides
//! (`runs.rs`: e.g. the blocks of one slot index across the slabs of a registration piece) and
//! each piece of each layer over a run is ONE pitched copy: a layer of 512 pages of 9 MiB in
//! 64 MiB slabs is 28 copies of up to 64 rows (4 GiB registration pieces) instead of 148 of up
//! to 7 rows (one slab's blocks, the plan before). Only a layer's last copy is a unit end: the
//! copy thread fences there, which is when the layer is reported.
//!
//! Inside a layer the copies of one piece may go in another order than the pages were given;
//! that moves the same bytes to the same places because the device rows of one piece of
//! distinct pages never overlap (distinct page ids, page stride at least the piece). When that
//! does not hold (a page id twice, overlapping pages), the plan keeps the page order
//! ([`page_order_layer_ops`], the plan before runs).

use std::collections::HashSet;

use kvnode_proto::gpu::{GpuLayout, LayoutError};

use crate::CopyOp;
use crate::runs::{HostPieces, Run, runs};

/// Largest copy a run of pages is fused into.
pub const LAYER_RUN_MAX_BYTES: u64 = 64 << 20;

/// Copies in layer order, and where each layer's copies end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerPlan {
    /// The copies, layer 0's first.
    pub ops: Vec<CopyOp>,
    /// Per layer, the index one past its last copy in `ops` (non-decreasing; a layer with no
    /// pages ends where the previous one did).
    pub layer_ends: Vec<usize>,
}

/// The pieces of block bytes `[lo, hi)` of page `p`: `(device offset, offset in block, len)`.
fn layer_pieces(
    layout: &GpuLayout,
    p: u64,
    lo: u64,
    hi: u64,
) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    layout.extents(p).filter_map(move |(dev, in_block, len)| {
        let (a, b) = (in_block.max(lo), (in_block + len).min(hi));
        (a < b).then(|| (dev + (a - in_block), a, b - a))
    })
}

/// The layer-ordered copies of `pages` (`(host address of the page's block, page id)`, page
/// ids validated) between `layout` in the mapping at device address `mapping` and the arena,
/// each piece of a layer one pitched copy per run of pages (module doc). `regs`: the arena's
/// CUDA registrations, which no copy's host rows may span.
pub fn layer_ops(
    layout: &GpuLayout,
    mapping: u64,
    pages: &[(usize, u64)],
    layers: u32,
    regs: HostPieces,
) -> Result<LayerPlan, LayoutError> {
    let per = layout.layer_bytes(layers)?;
    let widest = layout.objects.iter().map(|o| o.size).max().unwrap_or(0);
    let distinct = pages.iter().map(|&(_, p)| p).collect::<HashSet<_>>().len() == pages.len();
    let Some(&(_, first)) = pages.first() else {
        return Ok(LayerPlan {
            ops: Vec::new(),
            layer_ends: vec![0; layers as usize],
        });
    };
    if !distinct || layout.page_stride < widest {
        return page_order_layer_ops(layout, mapping, pages, layers, regs);
    }
    let bases: Vec<(u64, usize)> = pages
        .iter()
        .map(|&(host, p)| (layout.page_start(p), host))
        .collect();
    let groups = runs(&bases, widest, layout.page_bytes(), regs);
    let origin = layout.page_start(first);
    let mut plan = LayerPlan::default();
    for l in 0..u64::from(layers) {
        let start = plan.ops.len();
        for (dev, in_block, len) in layer_pieces(layout, first, l * per, (l + 1) * per) {
            for r in &groups {
                let (dev, host) = (mapping + r.dev + (dev - origin), r.host + in_block as usize);
                push_run(&mut plan.ops, start, regs, run_ops(r, dev, host, len));
            }
        }
        if plan.ops.len() > start {
            plan.ops.last_mut().expect("non-empty").unit_end = true;
        }
        plan.layer_ends.push(plan.ops.len());
    }
    Ok(plan)
}

/// One piece (`len` bytes at `dev` / `host` in the run's first page) over run `r`: pitched
/// copies of at most [`LAYER_RUN_MAX_BYTES`], linear where the rows are back to back.
fn run_ops(r: &Run, dev: u64, host: usize, len: u64) -> impl Iterator<Item = CopyOp> {
    let per_op = (LAYER_RUN_MAX_BYTES / len).max(1);
    let r = *r;
    (0..r.rows).step_by(per_op as usize).map(move |i| {
        let rows = per_op.min(r.rows - i);
        let (dev, host) = (dev + i * r.dev_step, host + (i * r.host_step) as usize);
        let op = if rows == 1 || (r.dev_step == len && r.host_step == len) {
            CopyOp::linear(dev, host, len * rows)
        } else {
            CopyOp {
                dev,
                host,
                len,
                rows,
                dev_pitch: r.dev_step,
                host_pitch: r.host_step,
                unit_end: true,
            }
        };
        CopyOp {
            unit_end: false,
            ..op
        }
    })
}

/// Appends `ops` to a layer's copies (those from index `start`), merging a linear copy into the
/// previous one when they are back to back on both sides and in one registration piece.
fn push_run(
    plan: &mut Vec<CopyOp>,
    start: usize,
    regs: HostPieces,
    ops: impl Iterator<Item = CopyOp>,
) {
    for op in ops {
        let merged = plan.len() > start
            && plan.last_mut().is_some_and(|last| {
                regs.holding(last.host, last.bytes() + op.len).is_some()
                    && last.merge(&op, LAYER_RUN_MAX_BYTES)
            });
        if !merged {
            plan.push(op);
        }
    }
}

/// The layer-ordered copies of `pages` in the order given: piece by piece, page by page, a
/// copy fused with the previous one while both step evenly (the plan before runs; kept for
/// pages that may overlap on the device, and as the reference the run plan is tested against).
/// Arguments as [`layer_ops`].
pub fn page_order_layer_ops(
    layout: &GpuLayout,
    mapping: u64,
    pages: &[(usize, u64)],
    layers: u32,
    regs: HostPieces,
) -> Result<LayerPlan, LayoutError> {
    let per = layout.layer_bytes(layers)?;
    let mut plan = LayerPlan::default();
    for l in 0..u64::from(layers) {
        let (lo, hi) = (l * per, (l + 1) * per);
        let start = plan.ops.len();
        // The same layout gives every page the same pieces: walk piece k of every page, then
        // piece k+1, so equal pieces of consecutive pages sit next to each other and fuse.
        let per_page: Vec<Vec<(u64, u64, u64)>> = pages
            .iter()
            .map(|&(_, p)| layer_pieces(layout, p, lo, hi).collect())
            .collect();
        let k = per_page.first().map_or(0, Vec::len);
        for piece in 0..k {
            for (&(host, _), ps) in pages.iter().zip(&per_page) {
                let (dev, in_block, len) = ps[piece];
                let op = CopyOp {
                    unit_end: false,
                    ..CopyOp::linear(mapping + dev, host + in_block as usize, len)
                };
                let reg = regs.holding(op.host, op.len);
                let fused = plan.ops.len() > start
                    && plan.ops.last_mut().is_some_and(|last| {
                        let same = reg.is_some() && regs.holding(last.host, 1) == reg;
                        same && (last.merge(&op, LAYER_RUN_MAX_BYTES)
                            || last.fuse_row(&op, LAYER_RUN_MAX_BYTES))
                    });
                if !fused {
                    plan.ops.push(op);
                }
            }
        }
        if plan.ops.len() > start {
            plan.ops.last_mut().expect("non-empty").unit_end = true;
        }
        plan.layer_ends.push(plan.ops.len());
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use kvnode_proto::gpu::GpuObject;

    use super::*;

    const M: u64 = 1 << 40;

    /// Layer-first `[layer][K|V][page][chunk]`: 2 layers, 8 pages, 256-byte chunks.
    fn layer_first() -> GpuLayout {
        let (pages, chunk) = (8u64, 256u64);
        GpuLayout {
            base: 0,
            page_stride: chunk,
            pages,
            objects: (0..4)
                .map(|j| GpuObject {
                    offset: j * pages * chunk,
                    size: chunk,
                })
                .collect(),
        }
    }

    #[test]
    fn consecutive_pages_in_evenly_spaced_slots_make_one_copy_per_layer_object() {
        let l = layer_first();
        // Pages 2..5 in slots 4096 bytes apart (a slab's slots).
        let pages: Vec<(usize, u64)> = (0..4)
            .map(|i| (1 << 20 | (i * 4096), 2 + i as u64))
            .collect();
        let plan = layer_ops(&l, M, &pages, 2, HostPieces::NONE).unwrap();
        // Per layer: K of the 4 pages as one pitched copy, then V likewise.
        assert_eq!(plan.layer_ends, vec![2, 4]);
        let k1 = plan.ops[2];
        assert_eq!(
            (k1.len, k1.rows, k1.dev_pitch, k1.host_pitch),
            (256, 4, 256, 4096)
        );
        assert_eq!(k1.dev, M + 2 * 8 * 256 + 2 * 256); // object 2 (layer 1 K), page 2
        assert_eq!(k1.host, (1 << 20) + 512); // block bytes of layer 1 start at 512
        let ends: Vec<bool> = plan.ops.iter().map(|o| o.unit_end).collect();
        assert_eq!(ends, [false, true, false, true]);
        assert_eq!(plan.ops.iter().map(CopyOp::bytes).sum::<u64>(), 4 * 1024);
    }

    #[test]
    fn scattered_pages_copy_by_runs_and_a_page_first_layer_is_one_run_per_page() {
        let l = layer_first();
        let pages = [(0usize, 5u64), (8192, 1), (4096, 6)];
        let plan = layer_ops(&l, M, &pages, 2, HostPieces::NONE).unwrap();
        // Pages 5 and 6 step evenly (one page on the device, 4096 bytes in the arena) though
        // page 1 was given between them: one pitched copy per piece; page 1 alone.
        assert_eq!(plan.layer_ends, vec![4, 8]);
        assert_eq!(
            plan.ops[..2]
                .iter()
                .map(|o| (o.rows, o.host))
                .collect::<Vec<_>>(),
            [(1, 8192), (2, 0)]
        );
        assert_eq!((plan.ops[1].dev_pitch, plan.ops[1].host_pitch), (256, 4096));
        // The page-order plan finds no constant step: 2 pieces x 3 pages per layer.
        let old = page_order_layer_ops(&l, M, &pages, 2, HostPieces::NONE).unwrap();
        assert_eq!(old.layer_ends, vec![6, 12]);
        assert!(old.ops.iter().all(|o| o.rows == 1 && o.len == 256));
        // Page-first, 1 KiB pages, 4 layers: layer l of a page is bytes [256l, 256l+256).
        let pf = GpuLayout {
            base: 0,
            page_stride: 1024,
            pages: 8,
            objects: vec![GpuObject {
                offset: 0,
                size: 1024,
            }],
        };
        let pages: Vec<(usize, u64)> = (0..3).map(|i| (i * 1024, i as u64)).collect();
        let plan = layer_ops(&pf, M, &pages, 4, HostPieces::NONE).unwrap();
        assert_eq!(plan.layer_ends, vec![1, 2, 3, 4]);
        let op = plan.ops[1];
        assert_eq!(
            (
                op.dev,
                op.host,
                op.len,
                op.rows,
                op.dev_pitch,
                op.host_pitch
            ),
            (M + 256, 256, 256, 3, 1024, 1024)
        );
    }

    #[test]
    fn layer_counts_that_do_not_split_the_page_are_refused() {
        let l = layer_first(); // 1 KiB blocks
        for bad in [0, 3, 5000] {
            assert!(
                matches!(layer_ops(&l, M, &[(0, 0)], bad, HostPieces::NONE), Err(LayoutError::Layers { layers, .. }) if layers == bad)
            );
        }
        assert_eq!(
            layer_ops(&l, M, &[], 4, HostPieces::NONE)
                .unwrap()
                .layer_ends,
            vec![0; 4]
        );
    }
}
