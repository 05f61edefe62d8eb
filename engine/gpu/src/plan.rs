//! Turning a page of a [`GpuLayout`] into copies: one strided copy when the page's objects are
//! regular (equal sizes, constant step: every layer-outermost layout), otherwise one copy per
//! object, merging copies that are contiguous on both sides.
//!
//! A page's copies are appended after the previous page's, so "the first n copies completed"
//! still tells which pages are whole: page k is whole once the copy holding its last byte is.
//! Only a page's last copy is marked [`CopyOp::unit_end`], so the copy thread never puts a
//! fence (a cancel point) inside a page.
//! A page is merged into the previous copy only when it is one copy itself, so a page that
//! shares a copy with its predecessor is written all at once, never in part.

use kvnode_proto::gpu::GpuLayout;

use crate::CopyOp;

/// Largest copy that merging builds (the worker's default batch: a cancel waits for at most
/// a few of these).
pub const MERGE_MAX_BYTES: u64 = 16 << 20;

/// Appends the copies of page `p` between `layout` in the mapping at device address `mapping`
/// and the page's block at host address `host`. Call only on a validated layout with
/// `p < pages`.
pub fn page_ops(layout: &GpuLayout, mapping: u64, host: usize, p: u64, ops: &mut Vec<CopyOp>) {
    let start = ops.len();
    if let Some(s) = layout.strided() {
        let dev = mapping + layout.page_start(p) + s.offset;
        ops.push(CopyOp::strided(dev, host, s.width, s.rows, s.pitch));
    } else {
        for (dev, in_block, len) in layout.extents(p) {
            let op = CopyOp {
                unit_end: false,
                ..CopyOp::linear(mapping + dev, host + in_block as usize, len)
            };
            let merged = ops.len() > start
                && ops
                    .last_mut()
                    .is_some_and(|last| last.merge(&op, MERGE_MAX_BYTES));
            if !merged {
                ops.push(op);
            }
        }
        if let Some(last) = ops.last_mut() {
            last.unit_end = true;
        }
    }
    if ops.len() == start + 1 && start > 0 {
        let op = ops[start];
        if ops[start - 1].merge(&op, MERGE_MAX_BYTES) {
            ops.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use kvnode_proto::gpu::GpuObject;

    use super::*;

    fn layout(page_stride: u64, objects: &[(u64, u64)]) -> GpuLayout {
        GpuLayout {
            base: 64,
            page_stride,
            pages: 8,
            objects: objects
                .iter()
                .map(|&(offset, size)| GpuObject { offset, size })
                .collect(),
        }
    }

    const M: u64 = 1 << 40;

    #[test]
    fn a_layer_first_page_is_one_strided_copy() {
        // 3 objects of 256 B, one layer (8 pages x 256 B) apart.
        let l = layout(256, &[(0, 256), (2048, 256), (4096, 256)]);
        let mut ops = Vec::new();
        page_ops(&l, M, 1000, 5, &mut ops);
        assert_eq!(
            ops,
            vec![CopyOp {
                dev: M + 64 + 5 * 256,
                host: 1000,
                len: 256,
                rows: 3,
                dev_pitch: 2048,
                host_pitch: 256,
                unit_end: true,
            }]
        );
        // Consecutive pages in consecutive slots stay one copy each (a 2D copy never merges).
        page_ops(&l, M, 1000 + 768, 6, &mut ops);
        assert_eq!(ops.len(), 2);
        assert_eq!(ops[1].dev, M + 64 + 6 * 256);
    }

    #[test]
    fn irregular_objects_copy_one_by_one_and_contiguous_ones_merge() {
        // Objects 0 and 1 are back to back on the device and in the block; 2 is elsewhere.
        let l = layout(8192, &[(0, 128), (128, 256), (4096, 64)]);
        let mut ops = Vec::new();
        page_ops(&l, M, 0, 1, &mut ops);
        assert_eq!(
            ops,
            vec![
                CopyOp {
                    unit_end: false,
                    ..CopyOp::linear(M + 64 + 8192, 0, 384)
                },
                CopyOp::linear(M + 64 + 8192 + 4096, 384, 64),
            ]
        );
        assert!(ops.iter().all(|o| o.rows == 1));
    }

    #[test]
    fn whole_pages_contiguous_on_both_sides_merge_up_to_the_cap() {
        let page = 4 << 20;
        let l = layout(page, &[(0, page)]);
        let mut ops = Vec::new();
        for p in 0..6 {
            page_ops(&l, M, (p * page) as usize, p, &mut ops);
        }
        // 16 MiB cap: pages 0-3 in one copy, 4-5 in the next.
        assert_eq!(
            ops,
            vec![
                CopyOp::linear(M + 64, 0, 4 * page),
                CopyOp::linear(M + 64 + 4 * page, (4 * page) as usize, 2 * page),
            ]
        );
        // Not contiguous in the arena: no merge.
        let mut ops = Vec::new();
        page_ops(&l, M, 0, 0, &mut ops);
        page_ops(&l, M, (2 * page) as usize, 1, &mut ops);
        assert_eq!(ops.len(), 2);
        // Not contiguous on the device (page 3 after page 1): no merge.
        let mut ops = Vec::new();
        page_ops(&l, M, 0, 1, &mut ops);
        page_ops(&l, M, page as usize, 3, &mut ops);
        assert_eq!(ops.len(), 2);
    }

    #[test]
    fn a_multi_copy_page_never_merges_into_the_previous_page() {
        // Page p's last object (192..256) ends where page p+1's first object starts (256), and
        // the blocks are adjacent in the arena; but page p+1 is two copies: merging its head
        // into page p's copy would leave it half written if a cancel fell in between.
        let l = layout(256, &[(0, 32), (192, 64)]);
        assert_eq!(l.strided(), None);
        let mut ops = Vec::new();
        page_ops(&l, M, 0, 0, &mut ops);
        page_ops(&l, M, 96, 1, &mut ops);
        assert_eq!(ops.len(), 4);
        assert_eq!(
            ops[2],
            CopyOp {
                unit_end: false,
                ..CopyOp::linear(M + 64 + 256, 96, 32)
            }
        );
        assert_eq!(
            ops.iter().map(|o| o.unit_end).collect::<Vec<_>>(),
            [false, true, false, true]
        );
    }
}
