//! Layer-wise onload copy rate on a real GPU, without the daemon: the 32k-token prefix of a
//! Qwen3-8B-shaped layer-first pool (512 pages of 9 MiB = 36 layers x K/V objects of 128 KiB)
//! from an arena laid out as the daemon lays it out (7 blocks per 64 MiB slab, slab by slab),
//! copied by the daemon's copy thread with each plan, next to pinned memcpy of the same bytes,
//! with the arena registered with CUDA in 1 GiB pieces (the daemon before issue 44), in 4 GiB
//! pieces (after), and as one range. Plans are interleaved rep by rep; every plan's first rep
//! is checked (two words of every object of every page against the arena).
//! Prints per plan: copies in all, in layer 0, rows per copy, and GB/s (median of the reps).
//!
//! Run on a GPU host: `cargo run --release -p kvnode-gpu --example layer_onload [-- REPS]`;
//! `-- plan` prints the copy lists' shape only (no GPU needed).

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use cudarc::driver::sys;
use kvnode_gpu::cuda::CudaBackend;
use kvnode_gpu::mem::{DeviceBuffer, PinnedHost, pinned_copy_bandwidth};
use kvnode_gpu::register::HostRegistration;
use kvnode_gpu::{
    CopyOp, DeviceWorker, Dir, HostPieces, WorkerConfig, layer_ops, page_ops, page_order_layer_ops,
};
use kvnode_proto::gpu::{GpuLayout, GpuObject};

const MIB: u64 = 1 << 20;
const POOL: u64 = 514;
const PAGES: u64 = 512;
const LAYERS: u32 = 36;
const CHUNK: u64 = 128 << 10;
const SLAB: u64 = 64 * MIB;

fn layout() -> GpuLayout {
    GpuLayout {
        base: 0,
        page_stride: CHUNK,
        pages: POOL,
        objects: (0..2 * u64::from(LAYERS))
            .map(|j| GpuObject {
                offset: j * POOL * CHUNK,
                size: CHUNK,
            })
            .collect(),
    }
}

fn block() -> u64 {
    2 * u64::from(LAYERS) * CHUNK
}

/// Arena offset of page `j`'s block: slab by slab, 7 blocks of 9 MiB in each 64 MiB slab.
fn slot(j: u64) -> u64 {
    let per = SLAB / block();
    (j / per) * SLAB + (j % per) * block()
}

/// The host word at byte `off` of page `p`'s block: where it came from, to check placement.
fn word(p: u64, off: u64) -> u64 {
    (p << 40) | off
}

/// One plan: its copies, whether each layer is fenced, and the registration it needs.
struct Plan {
    name: String,
    ops: Vec<CopyOp>,
    fence_every_unit: bool,
    per_layer: usize,
    /// Whether the copies put the pool's layout on the device (checked on the first rep).
    check: bool,
    /// Measured under every registration (else only under the daemon's former 1 GiB pieces).
    core: bool,
}

/// `ops` with one unit end, at the last copy: the job is fenced once, at its end.
fn one_fence(mut ops: Vec<CopyOp>) -> Vec<CopyOp> {
    for o in &mut ops {
        o.unit_end = false;
    }
    if let Some(o) = ops.last_mut() {
        o.unit_end = true;
    }
    ops
}

fn pieces_name(regs: HostPieces) -> String {
    match regs.piece {
        0 => "one registration".into(),
        p => format!("{} GiB pieces", p >> 30),
    }
}

/// The plans for the arena at `base` registered as `regs`, copying to the pool at `dev`.
fn plans(dev: u64, base: usize, regs: HostPieces) -> Vec<Plan> {
    let l = layout();
    let pages: Vec<(usize, u64)> = (0..PAGES).map(|j| (base + slot(j) as usize, j)).collect();
    let mut page_wise = Vec::new();
    for &(h, p) in &pages {
        page_ops(&l, dev, h, p, &mut page_wise);
    }
    let linear: Vec<CopyOp> = pages
        .iter()
        .map(|&(h, p)| CopyOp::linear(dev + p * block(), h, block()))
        .collect();
    let old = page_order_layer_ops(&l, dev, &pages, LAYERS, regs).expect("layers divide");
    let new = layer_ops(&l, dev, &pages, LAYERS, regs).expect("layers divide");
    let span = layer_ops(&l, dev, &pages, LAYERS, HostPieces::NONE).expect("layers divide");
    let (lo, ln, ls) = (old.layer_ends[0], new.layer_ends[0], span.layer_ends[0]);
    let plan = |name: &str, ops: Vec<CopyOp>, fence_every_unit, per_layer| Plan {
        name: name.to_string(),
        ops,
        fence_every_unit,
        per_layer,
        check: true,
        core: false,
    };
    let runs = format!("layer-wise, runs in {} (after)", pieces_name(regs));
    vec![
        Plan {
            check: false,
            ..plan("arena blocks, 1D, 9 MiB each", linear, false, 0)
        },
        Plan {
            core: true,
            ..plan("page by page (one 2D copy a page)", page_wise, false, 0)
        },
        plan("layer-wise, page order (before)", old.ops.clone(), true, lo),
        plan(
            "layer-wise, page order, one fence",
            one_fence(old.ops),
            false,
            lo,
        ),
        Plan {
            core: true,
            ..plan(&runs, new.ops.clone(), true, ln)
        },
        Plan {
            core: true,
            ..plan("layer-wise, runs, one fence", one_fence(new.ops), false, ln)
        },
        plan("layer-wise, runs across pieces", span.ops, true, ls),
    ]
}

fn shape(p: &Plan) -> String {
    let mut rows: Vec<u64> = p.ops.iter().map(|o| o.rows).collect();
    rows.sort_unstable();
    let bytes: u64 = p.ops.iter().map(CopyOp::bytes).sum();
    format!(
        "{:>6} copies, {:>4} in layer 0, rows min/median/max {}/{}/{}, {:.2} MiB a copy",
        p.ops.len(),
        p.per_layer,
        rows[0],
        rows[rows.len() / 2],
        rows[rows.len() - 1],
        bytes as f64 / p.ops.len() as f64 / MIB as f64
    )
}

/// Page-aligned host memory, like the daemon's arena mapping.
struct Arena {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Arena {
    fn new(len: u64) -> Self {
        let layout = std::alloc::Layout::from_size_align(len as usize, 2 << 20).expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "arena allocation failed");
        let mut a = Self { ptr, layout };
        a.fill();
        a
    }

    fn words(&mut self) -> &mut [u64] {
        // SAFETY: our allocation, 2 MiB aligned, length a multiple of 8; one user at a time.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.layout.size() / 8) }
    }

    fn fill(&mut self) {
        let w = self.words();
        for p in 0..PAGES {
            let at = (slot(p) / 8) as usize;
            for (i, x) in w[at..at + (block() / 8) as usize].iter_mut().enumerate() {
                *x = word(p, 8 * i as u64);
            }
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Checks the first and last word of every object of every page on the device.
fn check(dev: &DeviceBuffer, back: &mut [u8]) -> Result<(), String> {
    dev.read(0, back).map_err(|e| e.to_string())?;
    for p in 0..PAGES {
        for o in 0..2 * u64::from(LAYERS) {
            let d = (o * POOL + p) * CHUNK;
            for off in [0, CHUNK - 8] {
                let at = (d + off) as usize;
                let got = u64::from_le_bytes(back[at..at + 8].try_into().expect("8 bytes"));
                if got != word(p, o * CHUNK + off) {
                    return Err(format!("page {p} object {o} byte {off}: {got:#x}"));
                }
            }
        }
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every plan `reps` times, interleaved; returns GB/s per plan (`None`: a copy failed).
fn measure(
    rt: &tokio::runtime::Runtime,
    wk: &DeviceWorker,
    dev: &DeviceBuffer,
    ps: &[Plan],
    reps: usize,
    back: &mut [u8],
) -> Vec<Option<f64>> {
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); ps.len()];
    let mut bad = vec![false; ps.len()];
    for rep in 0..reps {
        for (i, p) in ps.iter().enumerate() {
            if bad[i] {
                continue;
            }
            dev.fill(0).expect("memset");
            let ops = p.ops.clone();
            let t = Instant::now();
            // SAFETY: the arena outlives the wait and nothing writes it meanwhile.
            let r = unsafe { wk.submit_with(Dir::HostToDevice, dev.ptr, ops, p.fence_every_unit) }
                .and_then(|tk| rt.block_on(tk.wait()));
            let s = t.elapsed().as_secs_f64();
            let checked = match r {
                Ok(n) if n == p.ops.len() && rep == 0 && p.check => check(dev, back),
                Ok(n) if n == p.ops.len() => Ok(()),
                Ok(n) => Err(format!("{n} of {} copies", p.ops.len())),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = checked {
                println!("  {}: FAILED: {e}", p.name);
                bad[i] = true;
            }
            secs[i].push(s);
        }
    }
    let bytes = (PAGES * block()) as f64;
    secs.iter_mut()
        .zip(&bad)
        .map(|(s, &b)| (!b).then(|| bytes / median(s) / 1e9))
        .collect()
}

/// Registers the arena: in `piece`-byte pieces as the daemon does, or (0) as one range.
fn register(a: &Arena, len: u64, piece: u64) -> Option<HostRegistration> {
    if piece > 0 {
        // SAFETY: the arena stays mapped until after the registration drops (declared later).
        let r = unsafe {
            HostRegistration::register(a.ptr, len, piece, &AtomicBool::new(false), |_| {})
        };
        return Some(r.map_err(|(_, e)| e).expect("cuMemHostRegister"));
    }
    // SAFETY: as above; undone below before the arena is freed.
    let r = unsafe {
        sys::cuMemHostRegister_v2(a.ptr.cast(), len as usize, sys::CU_MEMHOSTREGISTER_PORTABLE)
    };
    assert_eq!(
        r,
        sys::CUresult::CUDA_SUCCESS,
        "cuMemHostRegister of the whole arena"
    );
    None
}

fn report(ps: &[Plan], gbps: &[Option<f64>], memcpy: f64) {
    println!("pinned cuMemcpyHtoDAsync, 64 MiB copies, same run: {memcpy:.2} GB/s");
    for (p, g) in ps.iter().zip(gbps) {
        match g {
            Some(g) => println!(
                "{:<56} {:>6.2} GB/s {:>5.1} % of memcpy | {}",
                p.name,
                g,
                g / memcpy * 100.0,
                shape(p)
            ),
            None => println!("{:<56} failed | {}", p.name, shape(p)),
        }
    }
}

fn main() {
    let arg = std::env::args().nth(1);
    let len = slot(PAGES - 1) + SLAB;
    if arg.as_deref() == Some("plan") {
        for piece in [1 << 30, 4 << 30, 0] {
            println!("{}:", pieces_name(HostPieces { base: 0, piece }));
            for p in plans(
                1 << 40,
                1 << 30,
                HostPieces {
                    base: 1 << 30,
                    piece,
                },
            ) {
                println!("  {:<52} {}", p.name, shape(&p));
            }
        }
        return;
    }
    let reps: usize = arg.and_then(|a| a.parse().ok()).unwrap_or(7);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dev = DeviceBuffer::alloc(0, POOL * block()).expect("device buffer");
    let pinned = PinnedHost::alloc(1 << 30).expect("pinned buffer");
    let arena = Arena::new(len);
    let mut back = vec![0u8; (POOL * block()) as usize];
    let wk = DeviceWorker::spawn(0, WorkerConfig::default(), || CudaBackend::new(0));
    let memcpy = |dev: &DeviceBuffer| {
        pinned_copy_bandwidth(dev, &pinned, 64 * MIB, 72, true).expect("memcpy") / 1e9
    };
    let base = arena.ptr as usize;
    // The daemon's former 1 GiB pieces (every plan), its 4 GiB pieces, one registration.
    for (i, piece) in [1u64 << 30, 4 << 30, 0].into_iter().enumerate() {
        let regs = HostPieces { base, piece };
        let t = Instant::now();
        let reg = register(&arena, len, piece);
        println!(
            "\narena of {} MiB registered, {}, in {:.2} s",
            len / MIB,
            pieces_name(regs),
            t.elapsed().as_secs_f64()
        );
        let ps: Vec<Plan> = plans(dev.ptr, base, regs)
            .into_iter()
            .filter(|p| i == 0 || p.core)
            .collect();
        let before = memcpy(&dev);
        let gbps = measure(&rt, &wk, &dev, &ps, reps, &mut back);
        report(&ps, &gbps, f64::midpoint(before, memcpy(&dev)));
        match reg {
            Some(r) => drop(r),
            // SAFETY: registered as one range by `register`; no copy in flight.
            None => unsafe {
                sys::cuMemHostUnregister(arena.ptr.cast());
            },
        }
    }
}
