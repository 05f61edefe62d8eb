//! Per-hit cost of a traced USDT site: kvnode's `nop; nop5` site against the `probe` crate's
//! one-`nop` site, untraced, with a trivial BPF program and with kvtrace's own programs, and
//! the `nop; nop5` site trapped on its `nop` as on a kernel without the uprobe optimization.
//!
//! The process calls each site in a loop and traces itself; a hit's cost is the loop's time
//! per call with the program attached minus without. Every traced run also checks that the
//! program saw every call with the right arguments. Run as root:
//! `cargo run --release -p kvtrace --example probe_cost [CALLS]`.

use std::hint::black_box;
use std::mem::MaybeUninit;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use kvnode_proto::obs::{OpKind, OpStatus};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, ProgramMut, UprobeMultiOpts, UsdtOpts};

mod skel {
    #![allow(
        clippy::pedantic,
        missing_debug_implementations,
        unsafe_op_in_unsafe_fn
    )]
    include!(concat!(env!("OUT_DIR"), "/kvtrace.skel.rs"));
}

use skel::{KvtraceSkel, KvtraceSkelBuilder};

const BYTES: u64 = 4096;
const LATENCY_NS: u64 = 25_000;
const DEMOTE_COUNTER: u32 = 6; // KVT_C_DEMOTE

/// The `probe` crate's site (one `nop`), same arguments as `kvnode:op_done`.
#[inline(never)]
fn legacy_op_done(req: u64) {
    let (op, st) = (OpKind::Get.code(), OpStatus::Ok.code());
    probe::probe!(
        kvbench, op_done, 1u64, req, op, 0u32, 1u32, BYTES, st, LATENCY_NS
    );
}

#[inline(never)]
fn legacy_op_start(req: u64) {
    probe::probe!(kvbench, op_start, 1u64, req, OpKind::Get.code(), 0u32, 1u32);
}

#[derive(Clone, Copy)]
struct Site {
    name: &'static str,
    provider: &'static str,
    op_done: fn(u64),
    op_start: fn(u64),
}

fn nop5_op_done(req: u64) {
    let (get, ok) = (OpKind::Get, OpStatus::Ok);
    kvnode_engine::probes::op_done(1, req, get, 0, 1, BYTES, ok, LATENCY_NS);
}

fn nop5_op_start(req: u64) {
    kvnode_engine::probes::op_start(1, req, OpKind::Get, 0, 1);
}

const SITES: [Site; 2] = [
    Site {
        name: "nop; nop5 (kvnode)",
        provider: "kvnode",
        op_done: nop5_op_done,
        op_start: nop5_op_start,
    },
    Site {
        name: "nop (probe crate)",
        provider: "kvbench",
        op_done: legacy_op_done,
        op_start: legacy_op_start,
    },
];

/// Nanoseconds per op of `calls` ops (`pair`: op_start + op_done, else op_done only).
fn run(site: Site, calls: u64, pair: bool) -> f64 {
    let t = Instant::now();
    for req in 0..calls {
        if pair {
            (site.op_start)(black_box(req));
        }
        (site.op_done)(black_box(req));
    }
    t.elapsed().as_nanos() as f64 / calls as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Program {
    /// kvtrace's `demote` program: one counter add, no argument read.
    Trivial,
    /// kvtrace's `op_done` program; `regs`: arguments from fixed registers, else the USDT spec.
    OpDone { regs: bool },
    /// `op_done` (registers) attached as a plain uprobe on the site's first byte, the `nop`:
    /// what a kernel without the nop5 optimization (or an older libbpf) does, an `int3` trap.
    OpDoneOnNop,
    /// `op_start` + `op_done` with `pair_ops` (`--kernel-latency`): two hits per op.
    KernelLatency,
}

impl Program {
    fn describe(self) -> &'static str {
        match self {
            Self::Trivial => "trivial (1 counter add)",
            Self::OpDone { regs: true } => "op_done, args from regs",
            Self::OpDone { regs: false } => "op_done, args via spec",
            Self::OpDoneOnNop => "op_done, int3 on the nop",
            Self::KernelLatency => "--kernel-latency (2 hits)",
        }
    }
}

fn load(
    storage: &mut MaybeUninit<libbpf_rs::OpenObject>,
    program: Program,
) -> anyhow::Result<KvtraceSkel<'_>> {
    let mut open = KvtraceSkelBuilder::default().open(storage)?;
    let ro = open.maps.rodata_data.as_deref_mut().context("rodata")?;
    ro.pair_ops = u8::from(program == Program::KernelLatency);
    ro.op_done_regs = u8::from(matches!(
        program,
        Program::OpDone { regs: true } | Program::OpDoneOnNop
    ));
    ro.one_daemon = 1;
    Ok(open.load()?)
}

/// File offset of the first byte (`nop`) of the `nop; nop5` site in `probes::op_done`.
fn op_done_nop_offset() -> anyhow::Result<usize> {
    const SITE: [u8; 6] = [0x90, 0x0f, 0x1f, 0x44, 0x00, 0x00];
    let f = kvnode_engine::probes::op_done as *const u8;
    // SAFETY: reads the function's own machine code, mapped readable and far longer than this.
    let code = unsafe { std::slice::from_raw_parts(f, 256) };
    let at = code
        .windows(6)
        .position(|w| w == SITE)
        .context("no nop; nop5 in op_done")?;
    let addr = f as usize + at;
    for line in std::fs::read_to_string("/proc/self/maps")?.lines() {
        let mut it = line.split_whitespace();
        let (range, off) = (it.next().unwrap_or(""), it.nth(1).unwrap_or("0"));
        let (lo, hi) = range.split_once('-').context("maps line")?;
        let (lo, hi) = (
            usize::from_str_radix(lo, 16)?,
            usize::from_str_radix(hi, 16)?,
        );
        if (lo..hi).contains(&addr) {
            return Ok(addr - lo + usize::from_str_radix(off, 16)?);
        }
    }
    bail!("op_done's site is in no mapping")
}

fn attach(prog: &ProgramMut<'_>, site: Site, name: &str) -> anyhow::Result<Link> {
    let pid = std::process::id().cast_signed();
    prog.attach_usdt_with_opts(
        pid,
        "/proc/self/exe",
        site.provider,
        name,
        UsdtOpts::default(),
    )
    .with_context(|| format!("attaching {}:{name}", site.provider))
}

/// Sums a per-CPU `op_hists` entry: (count, sum_ns, bytes).
fn op_get_hist(skel: &KvtraceSkel<'_>) -> anyhow::Result<(u64, u64, u64)> {
    let key = OpKind::Get.code().to_ne_bytes();
    let cpus = skel
        .maps
        .op_hists
        .lookup_percpu(&key, MapFlags::ANY)?
        .context("no entry")?;
    Ok(cpus.iter().fold((0, 0, 0), |(c, s, b), v| {
        // SAFETY: each per-CPU value is a `struct kvt_hist` of plain integers.
        let h: skel::types::kvt_hist = unsafe { std::ptr::read_unaligned(v.as_ptr().cast()) };
        (c + h.count, s + h.sum_ns, b + h.bytes)
    }))
}

/// Whether the kernel has mapped a uprobe trampoline into this process (it optimized a site).
fn optimized() -> anyhow::Result<bool> {
    Ok(std::fs::read_to_string("/proc/self/maps")?.contains("[uprobes-trampoline]"))
}

fn counter(skel: &KvtraceSkel<'_>, i: u32) -> anyhow::Result<u64> {
    let v = skel
        .maps
        .counters
        .lookup(&i.to_ne_bytes(), MapFlags::ANY)?
        .context("counter")?;
    Ok(u64::from_ne_bytes(v[..8].try_into()?))
}

/// One row: per-op ns untraced and traced, checking the program saw `rounds * calls` hits.
fn measure(site: Site, calls: u64, rounds: usize, program: Program) -> anyhow::Result<(f64, f64)> {
    let pair = program == Program::KernelLatency;
    let mut storage = MaybeUninit::uninit();
    let skel = load(&mut storage, program)?;
    let p = &skel.progs;
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        off.push(run(site, calls, pair));
        let links = match program {
            Program::Trivial => vec![attach(&p.demote, site, "op_done")?],
            Program::OpDone { .. } => vec![attach(&p.op_done, site, "op_done")?],
            Program::OpDoneOnNop => {
                let pid = std::process::id().cast_signed();
                let off = op_done_nop_offset()?;
                // A usdt program is loaded for uprobe_multi links, so attach it through one.
                let opts = UprobeMultiOpts {
                    offsets: vec![off],
                    ..UprobeMultiOpts::default()
                };
                vec![
                    p.op_done
                        .attach_uprobe_multi_with_opts(pid, "/proc/self/exe", "", opts)?,
                ]
            }
            Program::KernelLatency => vec![
                attach(&p.op_start, site, "op_start")?,
                attach(&p.op_done, site, "op_done")?,
            ],
        };
        on.push(run(site, calls, pair));
        drop(links);
        if site.provider == "kvnode" && !optimized()? {
            eprintln!(
                "probe_cost: no [uprobes-trampoline] mapping: the nop5 site was not optimized"
            );
        }
    }
    let n = calls * rounds as u64;
    let name = site.name;
    if program == Program::Trivial {
        ensure!(counter(&skel, DEMOTE_COUNTER)? == n, "{name}: missed hits");
    } else {
        let (c, s, b) = op_get_hist(&skel)?;
        ensure!(
            c == n && b == n * BYTES,
            "{name}: {c} hits, {b} bytes for {n} calls"
        );
        if pair {
            ensure!(counter(&skel, 0)? == 0, "{name}: unmatched op_done");
        } else {
            ensure!(s == n * LATENCY_NS, "{name}: latency argument misread");
        }
    }
    Ok((median(off), median(on)))
}

fn main() -> anyhow::Result<()> {
    let calls: u64 = match std::env::args().nth(1) {
        Some(a) => a.parse().context("CALLS")?,
        None => 200_000,
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("run as root (it loads BPF programs)");
    }
    let [nop5, nop] = SITES;
    let rows = [
        (nop5, Program::Trivial),
        (nop, Program::Trivial),
        (nop5, Program::OpDone { regs: true }),
        (nop5, Program::OpDone { regs: false }),
        (nop5, Program::OpDoneOnNop),
        (nop, Program::OpDone { regs: false }),
        (nop5, Program::KernelLatency),
        (nop, Program::KernelLatency),
    ];
    println!("{calls} calls per run, median of 5 runs; cost = traced - untraced, per op");
    println!(
        "{:<20} {:<26} {:>11} {:>11} {:>9}",
        "site", "program", "untraced", "traced", "cost"
    );
    for (site, program) in rows {
        let (off, on) = measure(site, calls, 5, program)?;
        println!(
            "{:<20} {:<26} {off:>8.1} ns {on:>8.1} ns {:>6.0} ns",
            site.name,
            program.describe(),
            on - off
        );
    }
    Ok(())
}
