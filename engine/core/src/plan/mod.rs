//! Fetch plans: the leading keys worth fetching, cut where fetching more would take longer
//! than recomputing it (docs/fetch-plans.md). Pure arithmetic over the live cost model's
//! figures ([`crate::obs::cost`]) and the engine's [`RecomputeCost`].
//!
//! ```text
//!  keys in prefix order: [dram dram nvme nvme nvme | peer peer ...]   (what could be served)
//!  fetch(k)  = Σ fixed of the sources used in the first k
//!            + dram bytes / read rate
//!            + max(nvme bytes / nvme rate, nvme bytes / read rate)   (promotion streams
//!                                                                     under the read)
//!            + peer bytes / peer rate + peer bytes / read rate   (overlapped like nvme
//!                                                                 when read into a GPU)
//!  saved(k)  = T(start, end) − T(tokens before key k, end) − fetch(k) × (1 + margin)
//!              (T: the engine's cost of the prompt's tail after a cached prefix, to its end)
//!  plan      = the k (at a page boundary) with the largest saved(k) > 0, else 0
//! ```
//!
//! The plan stops before the first NVMe or peer key whose path has never been measured.
//! Where it stops at such a path, or at one whose figure is older than
//! [`Probing::reprobe_s`], it takes a bounded run from it (a probe) so a new or changed path
//! is measured by a small fetch instead of a multi-second bet. The DRAM read path is
//! assumed at [`DRAM_DEFAULT`] until measured.

use kvnode_proto::plan::{FetchPlan, PlanReason, PlanRun, PlanSource, ReadPath, RecomputeCost};

use crate::obs::cost::Figure;

/// How unmeasured (or long unmeasured) paths are probed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Probing {
    /// Most bytes a probe takes from a path with no figure at all.
    pub probe_bytes: u64,
    /// Most predicted seconds a probe of a measured but stale path may cost.
    pub probe_s: f64,
    /// A figure older than this is probed again (so a path that recovered is seen).
    pub reprobe_s: f64,
    /// A fetch is planned only where it beats recomputing with its predicted time raised by
    /// this fraction: measured I/O rates scatter (a disk's reads vary with what else it
    /// does), an engine's prefill much less, and a wrong fetch costs more than a wrong
    /// recompute.
    pub margin: f64,
}

impl Default for Probing {
    fn default() -> Self {
        Self {
            probe_bytes: 4 << 20,
            probe_s: 0.02,
            reprobe_s: 30.0,
            margin: 0.1,
        }
    }
}

/// The DRAM read path's figure before anything was measured: 10 GB/s and 50 µs (a copy out
/// of DRAM; the first reads replace it with what the path measures).
pub const DRAM_DEFAULT: Figure = Figure {
    fixed_s: 5e-5,
    bytes_per_s: 1e10,
    age_s: 0.0,
};

/// The figures a plan is made with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Figures {
    /// DRAM → the engine, by the request's read path (`None`: [`DRAM_DEFAULT`]).
    pub read: Option<Figure>,
    /// NVMe → DRAM.
    pub nvme: Option<Figure>,
    /// The hinted peer → DRAM.
    pub peer: Option<Figure>,
}

/// One key the daemon could serve: from where, and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Avail {
    /// Source.
    pub source: PlanSource,
    /// Bytes.
    pub bytes: u64,
}

#[derive(Default, Clone, Copy)]
struct Acc {
    all: u64,
    nvme: u64,
    peer: u64,
}

impl Acc {
    fn add(&mut self, a: Avail) {
        self.all += a.bytes;
        match a.source {
            PlanSource::Dram => {}
            PlanSource::Nvme => self.nvme += a.bytes,
            PlanSource::Peer => self.peer += a.bytes,
        }
    }
}

struct Model {
    f: Figures,
    via: ReadPath,
}

impl Model {
    fn fig(&self, s: PlanSource) -> Option<Figure> {
        match s {
            PlanSource::Dram => Some(self.f.read.unwrap_or(DRAM_DEFAULT)),
            PlanSource::Nvme => self.f.nvme,
            PlanSource::Peer => self.f.peer,
        }
    }

    /// Predicted seconds to fetch bytes `a`; a source with no figure is costed at the
    /// DRAM default (only a probe's run is ever taken from one).
    fn fetch_s(&self, a: Acc) -> f64 {
        if a.all == 0 {
            return 0.0;
        }
        let read = self.f.read.unwrap_or(DRAM_DEFAULT);
        let rd = |b: u64| b as f64 / read.bytes_per_s;
        let mut t = read.fixed_s + rd(a.all - a.nvme - a.peer);
        if a.nvme > 0 {
            let n = self.f.nvme.unwrap_or(DRAM_DEFAULT);
            t += n.fixed_s + (a.nvme as f64 / n.bytes_per_s).max(rd(a.nvme));
        }
        if a.peer > 0 {
            let p = self.f.peer.unwrap_or(DRAM_DEFAULT);
            let pull = a.peer as f64 / p.bytes_per_s;
            t += p.fixed_s
                + if self.via == ReadPath::Gpu {
                    pull.max(rd(a.peer))
                } else {
                    pull + rd(a.peer)
                };
        }
        t
    }
}

/// How far a probe of the source at `at` may go (exclusive end): `None` when that source is
/// measured and fresh.
fn probe_end(keys: &[Avail], at: usize, fig: Option<Figure>, p: &Probing) -> Option<usize> {
    let budget = match fig {
        None => p.probe_bytes,
        Some(f) if f.age_s > p.reprobe_s => {
            ((p.probe_s - f.fixed_s).max(0.0) * f.bytes_per_s) as u64
        }
        Some(_) => return None,
    };
    let s = keys[at].source;
    let mut bytes = 0u64;
    let mut end = at;
    while end < keys.len() && keys[end].source == s {
        bytes += keys[end].bytes;
        if end > at && bytes > budget {
            break;
        }
        end += 1;
    }
    Some(end)
}

/// The plan for `keys` (what could be served, in prefix order).
pub fn plan(keys: &[Avail], cost: &RecomputeCost, f: &Figures, p: &Probing) -> FetchPlan {
    let m = Model {
        f: *f,
        via: cost.via,
    };
    // Nothing is planned past a path never measured (but a probe, below).
    let limit = keys
        .iter()
        .position(|a| m.fig(a.source).is_none())
        .unwrap_or(keys.len());
    let kpp = cost.keys_per_page as usize;
    let (mut best, mut best_saved) = (0usize, 0.0f64);
    let mut acc = Acc::default();
    for (k, a) in keys[..limit].iter().enumerate() {
        acc.add(*a);
        let n = k + 1;
        if n % kpp != 0 && n != keys.len() {
            continue;
        }
        let saved = cost.saved_s(n as u64, keys.len() as u64) - m.fetch_s(acc) * (1.0 + p.margin);
        if saved > best_saved {
            (best, best_saved) = (n, saved);
        }
    }
    // Stopped at a path never measured, or at one measured long ago: take a bounded run of
    // it, at a loss if need be: it is how the path gets (re)measured.
    let mut probe = None;
    if best < keys.len() {
        let s = keys[best].source;
        if let Some(end) = probe_end(keys, best, m.fig(s), p) {
            best = end.div_ceil(kpp).saturating_mul(kpp).min(keys.len());
            probe = Some(s);
        }
    }
    let mut acc = Acc::default();
    keys[..best].iter().for_each(|a| acc.add(*a));
    finish(keys, cost, best, m.fetch_s(acc), probe)
}

fn finish(
    keys: &[Avail],
    cost: &RecomputeCost,
    n: usize,
    fetch_s: f64,
    probe: Option<PlanSource>,
) -> FetchPlan {
    let mut runs: Vec<PlanRun> = Vec::new();
    for a in &keys[..n] {
        match runs.last_mut() {
            Some(r) if r.source == a.source => r.keys += 1,
            _ => runs.push(PlanRun {
                source: a.source,
                keys: 1,
            }),
        }
    }
    let recompute_s = cost.saved_s(n as u64, keys.len() as u64);
    let (reason, cut_by) = if keys.is_empty() {
        (PlanReason::Nothing, None)
    } else if probe.is_some() {
        (PlanReason::Probe, probe)
    } else if n == keys.len() {
        (PlanReason::All, None)
    } else {
        (PlanReason::Slower, Some(keys[n].source))
    };
    let m = keys.len();
    let src = |s: Option<PlanSource>| match s {
        Some(PlanSource::Dram) => "the DRAM read",
        Some(PlanSource::Nvme) => "the NVMe tier",
        Some(PlanSource::Peer) => "the peer",
        None => "a path",
    };
    let ms = |s: f64| s * 1e3;
    let note = match reason {
        PlanReason::Nothing => "nothing held or hinted".to_owned(),
        PlanReason::All => format!(
            "fetch all {n} keys: {:.1} ms against {:.1} ms to recompute",
            ms(fetch_s),
            ms(recompute_s)
        ),
        PlanReason::Probe => format!(
            "fetch {n} of {m} keys: {} has no recent measurement, probed with a bounded run",
            src(cut_by)
        ),
        PlanReason::Slower if n == 0 => format!(
            "recompute all {m} keys: {} is slower than recomputing them",
            src(cut_by)
        ),
        PlanReason::Slower => format!(
            "fetch {n} of {m} keys ({:.1} ms against {:.1} ms to recompute); past them {} is slower than recomputing",
            ms(fetch_s),
            ms(recompute_s),
            src(cut_by)
        ),
    };
    FetchPlan {
        keys: n as u32,
        runs,
        fetch_s,
        recompute_s,
        reason,
        cut_by,
        available: keys.len() as u32,
        note,
    }
}

#[cfg(test)]
mod tests;
