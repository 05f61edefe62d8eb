//! Layer-wise copy plans: every page's layer 0, then every page's layer 1, …, so an engine can
//! run layer 0 of its forward pass while later layers are still on the way.
//!
//! A block is `layers` equal runs in model order (layer `l` = block bytes
//! `[l*B/layers, (l+1)*B/layers)`); its pieces in a GPU page follow the layout's objects
//! (a layer-first page's layer is its K and V objects of that layer, a page-first page's layer
//! is one contiguous run). Within a layer the copies go piece by piece, page by page, and a
//! run of pages whose pieces step by a constant amount on both sides (consecutive page ids on
//! the device, equally spaced arena slots) becomes ONE pitched copy (`CopyOp::fuse_row`), so
//! a layer of a few hundred pages is a handful of copies, not one per page. Only a layer's
//! last copy is a unit end: the copy thread fences there, which is when the layer is reported.

use kvnode_proto::gpu::{GpuLayout, LayoutError};

use crate::CopyOp;

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
fn pieces(
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
/// ids validated) between `layout` in the mapping at device address `mapping` and the arena.
pub fn layer_ops(
    layout: &GpuLayout,
    mapping: u64,
    pages: &[(usize, u64)],
    layers: u32,
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
            .map(|&(_, p)| pieces(layout, p, lo, hi).collect())
            .collect();
        let k = per_page.first().map_or(0, Vec::len);
        for piece in 0..k {
            for (&(host, _), ps) in pages.iter().zip(&per_page) {
                let (dev, in_block, len) = ps[piece];
                let op = CopyOp {
                    unit_end: false,
                    ..CopyOp::linear(mapping + dev, host + in_block as usize, len)
                };
                let fused = plan.ops.len() > start
                    && plan.ops.last_mut().is_some_and(|last| {
                        last.merge(&op, LAYER_RUN_MAX_BYTES)
                            || last.fuse_row(&op, LAYER_RUN_MAX_BYTES)
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
        let plan = layer_ops(&l, M, &pages, 2).unwrap();
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
    fn scattered_pages_copy_piece_by_piece_and_a_page_first_layer_is_one_run_per_page() {
        let l = layer_first();
        let pages = [(0usize, 5u64), (8192, 1), (4096, 6)];
        let plan = layer_ops(&l, M, &pages, 2).unwrap();
        // No constant step: 2 pieces x 3 pages per layer.
        assert_eq!(plan.layer_ends, vec![6, 12]);
        assert!(plan.ops.iter().all(|o| o.rows == 1 && o.len == 256));
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
        let plan = layer_ops(&pf, M, &pages, 4).unwrap();
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
                matches!(layer_ops(&l, M, &[(0, 0)], bad), Err(LayoutError::Layers { layers, .. }) if layers == bad)
            );
        }
        assert_eq!(layer_ops(&l, M, &[], 4).unwrap().layer_ends, vec![0; 4]);
    }
}
