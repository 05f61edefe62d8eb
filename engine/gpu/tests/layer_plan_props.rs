//! The run-grouped layer-wise plan (`layer_ops`) against the page-order plan it replaced
//! (`page_order_layer_ops`), over random layouts, page sets and arena slot patterns: every layer
//! moves every device byte from the same host byte, layer boundaries and unit ends are where a
//! layer ends, and no copy's host rows span two registration pieces.
//! Run: `cargo test --release -p kvnode-gpu --test layer_plan_props` (CPU only).

use std::collections::BTreeMap;

use kvnode_gpu::{CopyOp, HostPieces, LayerPlan, layer_ops, page_order_layer_ops};
use kvnode_proto::gpu::{GpuLayout, GpuObject};
use proptest::prelude::*;

const MAPPING: u64 = 1 << 40;
const ARENA: usize = 1 << 30;

/// What each device byte receives, in copy order (a later copy overwrites an earlier one).
fn landed(ops: &[CopyOp]) -> BTreeMap<u64, usize> {
    let mut m = BTreeMap::new();
    for op in ops {
        for (dev, host) in op.row_addrs() {
            for i in 0..op.len {
                m.insert(dev + i, host + i as usize);
            }
        }
    }
    m
}

fn per_layer(plan: &LayerPlan) -> Vec<&[CopyOp]> {
    let mut start = 0;
    plan.layer_ends
        .iter()
        .map(|&end| {
            let s = &plan.ops[start..end];
            start = end;
            s
        })
        .collect()
}

/// A layout with `pages` pages: `kind` 0 layer-first (`[layer][K|V][page][chunk]`), 1 page-first
/// (one object), 2 irregular objects with gaps, 3 pages that overlap (stride under the page).
fn layout(kind: u8, pages: u64, halves: u64, chunk: u64, sizes: &[u64]) -> GpuLayout {
    let obj = |offset, size| GpuObject { offset, size };
    match kind {
        0 => GpuLayout {
            base: 64,
            page_stride: chunk,
            pages,
            objects: (0..halves).map(|j| obj(j * pages * chunk, chunk)).collect(),
        },
        1 => GpuLayout {
            base: 0,
            page_stride: halves * chunk,
            pages,
            objects: vec![obj(0, halves * chunk)],
        },
        2 => {
            let (mut at, mut objects) = (0, Vec::new());
            for &s in sizes {
                objects.push(obj(at, s));
                at += s + 16;
            }
            GpuLayout {
                base: 16,
                page_stride: at,
                pages,
                objects,
            }
        }
        _ => GpuLayout {
            base: 0,
            page_stride: chunk / 2,
            pages,
            objects: vec![obj(0, halves * chunk)],
        },
    }
}

/// Host addresses of `n` blocks of `block` bytes: slots of slabs holding `per` blocks with
/// `gap` bytes left at each slab's end, taken in order from `first`, or at `shuffled` slots.
fn slots(n: usize, block: u64, per: u64, gap: u64, first: u64, shuffled: &[usize]) -> Vec<usize> {
    let at = |k: u64| ARENA + ((k / per) * (per * block + gap) + (k % per) * block) as usize;
    if shuffled.is_empty() {
        (0..n as u64).map(|k| at(first + k)).collect()
    } else {
        shuffled.iter().take(n).map(|&k| at(k as u64)).collect()
    }
}

#[derive(Debug, Clone)]
struct Case {
    kind: u8,
    pool: u64,
    halves: u64,
    chunk: u64,
    sizes: Vec<u64>,
    layers: u32,
    ids: Vec<u64>,
    dup: bool,
    per: u64,
    gap: u64,
    first: u64,
    shuffle: bool,
    piece_slabs: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            0u8..4,
            2u64..14,
            1u64..5,
            prop::sample::select(vec![64u64, 128, 256]),
        ),
        prop::collection::vec(prop::sample::select(vec![64u64, 128, 192]), 1..4),
        prop::sample::select(vec![1u32, 2, 4]),
        (
            any::<bool>(),
            1u64..6,
            prop::sample::select(vec![0u64, 64, 320]),
            0u64..5,
        ),
        (any::<bool>(), 0u64..4, any::<u64>()),
    )
        .prop_flat_map(|((kind, pool, halves, chunk), sizes, layers, slab, tail)| {
            let halves = if kind == 0 { 2 * halves } else { halves };
            let ids = Just((0..pool).collect::<Vec<u64>>()).prop_shuffle();
            let n = 1..=pool as usize;
            (ids, n).prop_map(move |(mut ids, n)| {
                ids.truncate(n);
                let (dup, per, gap, first) = slab;
                let (shuffle, piece_slabs, _) = tail;
                Case {
                    kind,
                    pool,
                    halves,
                    chunk,
                    sizes: sizes.clone(),
                    layers,
                    ids,
                    dup,
                    per,
                    gap,
                    first,
                    shuffle,
                    piece_slabs,
                }
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn run_plan_moves_every_byte_as_the_page_order_plan(c in case(), seed in any::<u64>()) {
        let l = layout(c.kind, c.pool, c.halves, c.chunk, &c.sizes);
        let block = l.page_bytes();
        let mut ids = c.ids.clone();
        if c.dup && ids.len() > 1 {
            let last = ids.len() - 1;
            ids[last] = ids[0];
        }
        let order: Vec<usize> = if c.shuffle {
            let mut v: Vec<usize> = (0..ids.len() + 8).collect();
            // A cheap deterministic shuffle from the seed (slots scattered over the arena).
            let mut s = seed | 1;
            for i in (1..v.len()).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                v.swap(i, (s % (i as u64 + 1)) as usize);
            }
            v
        } else {
            Vec::new()
        };
        let hosts = slots(ids.len(), block, c.per, c.gap, c.first, &order);
        let pages: Vec<(usize, u64)> = hosts.into_iter().zip(ids.iter().copied()).collect();
        let regs = match c.piece_slabs {
            0 => HostPieces::NONE,
            k => HostPieces { base: ARENA, piece: k * (c.per * block + c.gap) },
        };
        for layers in [c.layers, 1] {
            let Ok(old) = page_order_layer_ops(&l, MAPPING, &pages, layers, HostPieces::NONE) else {
                prop_assert!(layer_ops(&l, MAPPING, &pages, layers, regs).is_err());
                continue;
            };
            let new = layer_ops(&l, MAPPING, &pages, layers, regs).unwrap();
            prop_assert_eq!(new.layer_ends.len(), layers as usize);
            for (a, b) in per_layer(&old).into_iter().zip(per_layer(&new)) {
                prop_assert_eq!(landed(a), landed(b));
                let ends: Vec<bool> = b.iter().map(|o| o.unit_end).collect();
                prop_assert!(ends.iter().rev().skip(1).all(|&e| !e), "unit end inside a layer");
                prop_assert!(ends.last().is_none_or(|&e| e), "a layer ends with a unit end");
            }
            for op in &new.ops {
                prop_assert!(op.rows >= 1 && op.dev_pitch >= op.len && op.host_pitch >= op.len);
                let piece = regs_of(regs, op.host, op.len);
                prop_assert!(piece.is_some(), "a row spans two pieces: {:?}", op);
                for (_, h) in op.row_addrs() {
                    prop_assert_eq!(regs_of(regs, h, op.len), piece, "rows in two pieces: {:?}", op);
                }
            }
        }
    }
}

/// The registration piece holding `[a, a + len)`, if one does.
fn regs_of(r: HostPieces, a: usize, len: u64) -> Option<u64> {
    if r.piece == 0 {
        return Some(0);
    }
    let of = |x: usize| (x - r.base) as u64 / r.piece;
    (of(a) == of(a + len as usize - 1)).then(|| of(a))
}

#[test]
fn the_32k_prefix_is_a_few_dozen_copies_per_layer() {
    // 512 pages of Qwen3-8B's layer-first pool (36 layers, K and V of 128 KiB), 7 blocks per
    // 64 MiB slab allocated slab by slab (the daemon's default slab).
    let (pool, chunk, layers) = (514u64, 128u64 << 10, 36u32);
    let l = layout(0, pool, 2 * u64::from(layers), chunk, &[]);
    let block = l.page_bytes();
    let hosts = slots(512, block, 7, (64 << 20) - 7 * block, 0, &[]);
    let pages: Vec<(usize, u64)> = hosts.into_iter().zip(0..512).collect();
    let regs = |piece| HostPieces { base: ARENA, piece };
    let bytes = |p: &LayerPlan| p.ops.iter().map(CopyOp::bytes).sum::<u64>();
    let old = page_order_layer_ops(&l, MAPPING, &pages, layers, regs(1 << 30)).unwrap();
    // Page order: K and V over each slab's 7 pages (74 slabs) per layer.
    assert_eq!(old.ops.len(), 36 * 2 * 74);
    for (piece, per_layer, rows) in [
        (1u64 << 30, 2 * 35, 16),
        (4 << 30, 2 * 14, 64),
        (0, 2 * 7, 74),
    ] {
        let new = layer_ops(&l, MAPPING, &pages, layers, regs(piece)).unwrap();
        // Per registration piece, one run per slot index: 7 runs of 16 pages in a 1 GiB piece
        // (4 whole pieces and 64 pages in a fifth), 7 of 64 in a 4 GiB one (and 64 pages).
        assert_eq!(new.ops.len(), 36 * per_layer, "pieces of {piece} bytes");
        assert_eq!(new.ops[0].rows, rows);
        assert_eq!(bytes(&new), bytes(&old));
    }
    assert_eq!(bytes(&old), 512 * block);
}
