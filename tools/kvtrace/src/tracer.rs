//! Loads the BPF object, attaches it to the daemons and reads its maps into reports.

use std::collections::BTreeMap;
use std::mem::MaybeUninit;

use anyhow::Context;
use kvnode_proto::obs::{LatencyHistogram, OpKind, log2_buckets};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject, UsdtOpts};

use crate::abi::{self, COUNTERS, kvt_hist, kvt_hist_key};
use crate::skel::{KvtraceSkel, KvtraceSkelBuilder};

/// What to attach. Each attached probe costs a uprobe hit every time the daemon fires it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// USDT probes to attach (`op_start` is added by `pair_ops`).
    pub probes: &'static [&'static str],
    /// Emit an event for completed ops slower than this (0 = off).
    pub op_slow_ns: u64,
    /// Trace io_uring and emit events for completions slower than this (0 = io_uring off).
    pub uring_slow_ns: u64,
    /// Measure op latency in the kernel from `op_start` to `op_done` (two hits per op)
    /// instead of taking the daemon's figure from `op_done` (one hit).
    pub pair_ops: bool,
    /// Send stall and lease events to the ring buffer (else they are only counted).
    pub events: bool,
}

/// `kvtrace latency`: op, tier and peer histograms.
pub const LATENCY: &[&str] = &["op_done", "spill_complete", "peer_pull_done", "promote"];
/// `kvtrace record`: the histograms and every counter.
pub const RECORD: &[&str] = &[
    "op_done",
    "spill_complete",
    "peer_pull_done",
    "promote",
    "evict",
    "demote",
    "cancel",
    "fence",
    "stall",
    "lease_overdue",
];
/// `kvtrace stalls` (plus `op_done` with `--op-slow-ms`).
pub const STALLS: &[&str] = &["stall", "lease_overdue"];
/// `kvtrace stalls --op-slow-ms`.
pub const STALLS_SLOW_OPS: &[&str] = &["stall", "lease_overdue", "op_done"];

/// Probes every kvnode daemon has; the others may be missing from an older build.
const REQUIRED: [&str; 2] = ["op_start", "op_done"];

/// The loaded programs and their links (detached on drop).
pub struct Tracer<'o> {
    pub skel: KvtraceSkel<'o>,
    _links: Vec<Link>,
    pub pids: Vec<u32>,
}

/// One histogram as read from the map, keyed for display.
#[derive(Debug, Clone, Copy)]
pub struct Raw {
    pub slots: [u64; 64],
    pub count: u64,
    pub sum_ns: u64,
    pub bytes: u64,
    pub max_ns: u64,
}

impl Default for Raw {
    fn default() -> Self {
        Self {
            slots: [0; 64],
            count: 0,
            sum_ns: 0,
            bytes: 0,
            max_ns: 0,
        }
    }
}

impl From<&kvt_hist> for Raw {
    fn from(h: &kvt_hist) -> Self {
        Self {
            slots: h.slots,
            count: h.count,
            sum_ns: h.sum_ns,
            bytes: h.bytes,
            max_ns: h.max_ns,
        }
    }
}

impl Raw {
    fn merge(&mut self, o: &Raw) {
        for (a, b) in self.slots.iter_mut().zip(o.slots) {
            *a += b;
        }
        self.count += o.count;
        self.sum_ns += o.sum_ns;
        self.bytes += o.bytes;
        self.max_ns = self.max_ns.max(o.max_ns);
    }

    /// `self - earlier` (for interval views); max stays cumulative.
    pub fn since(&self, earlier: &Raw) -> Raw {
        let mut d = *self;
        for (a, b) in d.slots.iter_mut().zip(earlier.slots) {
            *a -= b;
        }
        d.count -= earlier.count;
        d.sum_ns -= earlier.sum_ns;
        d.bytes -= earlier.bytes;
        d
    }

    pub fn export(&self, group: &str, name: &str) -> LatencyHistogram {
        LatencyHistogram {
            group: group.into(),
            name: name.into(),
            count: self.count,
            sum_ns: self.sum_ns,
            max_ns: self.max_ns,
            bytes: self.bytes,
            buckets: log2_buckets(&self.slots),
            percentiles: Vec::new(),
        }
    }
}

/// (group, name) of a map key; statuses are merged.
fn label(k: &kvt_hist_key, multi: bool) -> (String, String) {
    let (g, n) = match k.kind {
        abi::KVT_OP => (
            "op",
            OpKind::from_code(k.sub).map_or_else(|| format!("op{}", k.sub), |o| o.name().into()),
        ),
        abi::KVT_SPILL => (
            "tier",
            format!("nvme {}", if k.aux == 1 { "write" } else { "read" }),
        ),
        abi::KVT_PEER => ("peer", format!("peer#{}", k.sub)),
        abi::KVT_URING => ("uring", "io_uring".into()),
        abi::KVT_PROMOTE => ("tier", "promote".into()),
        _ => ("other", format!("kind{}", k.kind)),
    };
    let n = if multi {
        format!("{n} [{}]", k.tgid)
    } else {
        n
    };
    (g.into(), n)
}

impl<'o> Tracer<'o> {
    /// Opens, loads and attaches to every pid in `pids`.
    pub fn attach(
        storage: &'o mut MaybeUninit<OpenObject>,
        pids: &[u32],
        opts: Options,
    ) -> anyhow::Result<Self> {
        let mut open = KvtraceSkelBuilder::default()
            .open(storage)
            .context("opening the BPF object")?;
        let ro = open
            .maps
            .rodata_data
            .as_deref_mut()
            .context("BPF rodata missing")?;
        ro.op_slow_ns = opts.op_slow_ns;
        ro.uring_slow_ns = opts.uring_slow_ns;
        ro.pair_ops = u8::from(opts.pair_ops);
        ro.events_on = u8::from(opts.events);
        ro.one_daemon = u8::from(pids.len() == 1);
        let mut fixed = true;
        for &pid in pids {
            fixed &= crate::target::op_done_in_fixed_regs(pid)?;
        }
        ro.op_done_regs = u8::from(fixed);
        let n = u32::try_from(pids.len()).context("too many pids")?;
        open.maps
            .op_hists
            .set_max_entries(abi::KVT_OPS * n.max(1))
            .context("sizing op_hists")?;
        if !opts.pair_ops {
            open.maps
                .inflight
                .set_max_entries(1)
                .context("sizing inflight")?;
        }
        let skel = open.load().context(
            "loading the BPF programs (kernel too old, or BPF disabled by lockdown/sysctl?)",
        )?;
        let mut links = attach_usdt(&skel, pids, &opts)?;
        let p = &skel.progs;
        if opts.uring_slow_ns > 0 {
            for (prog, tp) in [
                (&p.uring_submit, "io_uring_submit_req"),
                (&p.uring_complete, "io_uring_complete"),
            ] {
                match prog.attach_raw_tracepoint(tp) {
                    Ok(l) => links.push(l),
                    Err(e) => eprintln!(
                        "kvtrace: warning: io_uring tracepoint {tp} unavailable ({e}); slow io_uring completions will not be reported"
                    ),
                }
            }
        }
        Ok(Self {
            skel,
            _links: links,
            pids: pids.to_vec(),
        })
    }

    /// Every histogram, merged over statuses and CPUs, by (group, name).
    pub fn histograms(&self) -> BTreeMap<(String, String), Raw> {
        let multi = self.pids.len() > 1;
        let mut out: BTreeMap<(String, String), Raw> = BTreeMap::new();
        let m = &self.skel.maps.hists;
        for key in m.keys() {
            let Ok(Some(v)) = m.lookup(&key, MapFlags::ANY) else {
                continue;
            };
            let k: kvt_hist_key = abi::from_bytes(&key);
            let h: kvt_hist = abi::from_bytes(&v);
            out.entry(label(&k, multi))
                .or_default()
                .merge(&Raw::from(&h));
        }
        let m = &self.skel.maps.op_hists;
        for (d, &tgid) in self.pids.iter().enumerate() {
            for op in 0..abi::KVT_OPS {
                let i = d as u32 * abi::KVT_OPS + op;
                let Ok(Some(cpus)) = m.lookup_percpu(&i.to_ne_bytes(), MapFlags::ANY) else {
                    continue;
                };
                let mut sum = Raw::default();
                for v in &cpus {
                    sum.merge(&Raw::from(&abi::from_bytes::<kvt_hist>(v)));
                }
                if sum.count > 0 {
                    let k = kvt_hist_key {
                        tgid,
                        kind: abi::KVT_OP,
                        sub: op,
                        aux: 0,
                    };
                    out.entry(label(&k, multi)).or_default().merge(&sum);
                }
            }
        }
        out
    }

    /// Named counters.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        let m = &self.skel.maps.counters;
        COUNTERS
            .iter()
            .map(|(i, name)| {
                let v = m
                    .lookup(&i.to_ne_bytes(), MapFlags::ANY)
                    .ok()
                    .flatten()
                    .map_or(0, |b| abi::from_bytes::<u64>(&b));
                ((*name).to_owned(), v)
            })
            .collect()
    }
}

/// Attaches the wanted USDT probes to every daemon in `pids` (the cookie is the daemon's index)
/// and fills the pid filter.
fn attach_usdt(skel: &KvtraceSkel<'_>, pids: &[u32], opts: &Options) -> anyhow::Result<Vec<Link>> {
    let mut links = Vec::new();
    let p = &skel.progs;
    let all = [
        (&p.op_start, "op_start"),
        (&p.op_done, "op_done"),
        (&p.evict, "evict"),
        (&p.lease_overdue, "lease_overdue"),
        (&p.stall, "stall"),
        (&p.spill_complete, "spill_complete"),
        (&p.peer_pull_done, "peer_pull_done"),
        (&p.promote, "promote"),
        (&p.demote, "demote"),
        (&p.cancel, "cancel"),
        (&p.fence, "fence"),
    ];
    let wanted = |name: &str| opts.probes.contains(&name) || (opts.pair_ops && name == "op_start");
    for (i, &pid) in pids.iter().enumerate() {
        let exe = format!("/proc/{pid}/exe");
        // The cookie is the daemon's index: its op histograms are op_hists[i * KVT_OPS..].
        let cookie = UsdtOpts {
            cookie: i as u64,
            ..UsdtOpts::default()
        };
        for (prog, name) in all.iter().filter(|(_, n)| wanted(n)) {
            match prog.attach_usdt_with_opts(
                pid.cast_signed(),
                &exe,
                "kvnode",
                *name,
                cookie.clone(),
            ) {
                Ok(l) => links.push(l),
                // A daemon built before this probe existed: trace what it has.
                Err(e)
                    if e.kind() == libbpf_rs::ErrorKind::NotFound && !REQUIRED.contains(name) => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("attaching USDT kvnode:{name} to pid {pid}"));
                }
            }
        }
        skel.maps
            .pids
            .update(&pid.to_ne_bytes(), &[1], MapFlags::ANY)
            .context("filling the pid filter")?;
    }
    Ok(links)
}
