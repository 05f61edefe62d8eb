//! `--hold-prefill`: what requests waited for, per group. MEASURED on the replay's clock: the
//! queue wait (arrival at its sped-up trace time to its engine taking it) and the get's wall
//! time (with its pull, or its join of a prefetch in flight). MODELLED: the prefill (cost.rs),
//! divided by the speedup as the engines hold it. The replay-clock TTFT is their sum.

use std::fmt::Write;

use super::config::PrefetchAt;
use super::cost::CostModel;
use super::drive::Record;
use super::trace::Request;

/// p10, p50 and p90, ms.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct P {
    /// 10th percentile.
    pub p10: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
}

fn p(mut v: Vec<f64>) -> P {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if v.is_empty() {
            0.0
        } else {
            v[((v.len() as f64 - 1.0) * q).round() as usize]
        }
    };
    P {
        p10: at(0.1),
        p50: at(0.5),
        p90: at(0.9),
    }
}

/// One group of requests, on the replay's clock (ms).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Group {
    /// Requests.
    pub n: usize,
    /// Of them, those the router started a `kv.prefetch` for.
    pub prefetched: usize,
    /// MEASURED: arrival to the engine taking it.
    pub queue_ms: P,
    /// MEASURED: placement to the engine taking it (the window a prefetch at placement has).
    pub placed_ms: P,
    /// MEASURED: wall time of the get (a pull, or the join of a prefetch, included).
    pub get_ms: P,
    /// MODELLED prefill / speedup (what the engine held).
    pub prefill_ms: P,
    /// queue + get (measured) + prefill (modelled).
    pub ttft_ms: P,
}

/// The waits of one arm.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Waits {
    /// When hinted pulls started.
    pub prefetch_at: PrefetchAt,
    /// The replay's speedup (trace ms = replay ms x speedup for the queue and the prefill).
    pub speedup: f64,
    /// Requests the router started a `kv.prefetch` for.
    pub prefetched: usize,
    /// Requests whose get carried a hint (the router named a peer with a longer prefix).
    pub hinted: Group,
    /// Hinted requests whose get itself reported pulled blocks.
    pub get_pulled: Group,
    /// Hinted requests whose get found every leading block local (none pulled by the get).
    pub hinted_local: Group,
    /// Not hinted, leading blocks from the node's DRAM (a local DRAM hit).
    pub dram_hit: Group,
    /// Every request.
    pub all: Group,
}

fn group<'a>(
    it: impl Iterator<Item = (&'a Request, &'a Record)>,
    cost: &CostModel,
    speedup: f64,
) -> Group {
    let (mut q, mut g, mut f, mut t) = (vec![], vec![], vec![], vec![]);
    let mut pl = vec![];
    let mut prefetched = 0;
    for (r, rec) in it {
        prefetched += usize::from(rec.timing.prefetched);
        let pre = cost.prefill_ms(r, &rec.served) / speedup;
        let (qm, gm) = (rec.timing.queue_s * 1e3, rec.timing.get_s * 1e3);
        q.push(qm);
        pl.push(rec.timing.placed_s * 1e3);
        g.push(gm);
        f.push(pre);
        t.push(qm + gm + pre);
    }
    Group {
        n: q.len(),
        prefetched,
        queue_ms: p(q),
        placed_ms: p(pl),
        get_ms: p(g),
        prefill_ms: p(f),
        ttft_ms: p(t),
    }
}

/// The waits of `recs` (one per request of `trace`).
pub fn of(
    trace: &[Request],
    recs: &[Record],
    cost: &CostModel,
    speedup: f64,
    prefetch_at: PrefetchAt,
) -> Waits {
    let both = || trace.iter().zip(recs);
    let hinted = |rec: &Record| rec.timing.pulled;
    Waits {
        prefetch_at,
        speedup,
        prefetched: recs.iter().filter(|r| r.timing.prefetched).count(),
        hinted: group(both().filter(|(_, r)| hinted(r)), cost, speedup),
        get_pulled: group(
            both().filter(|(_, r)| hinted(r) && r.served.peer > 0),
            cost,
            speedup,
        ),
        hinted_local: group(
            both().filter(|(_, r)| hinted(r) && r.served.peer == 0),
            cost,
            speedup,
        ),
        dram_hit: group(
            both().filter(|(_, r)| !hinted(r) && r.served.dram > 0),
            cost,
            speedup,
        ),
        all: group(both(), cost, speedup),
    }
}

/// The text table of one arm's waits.
pub fn table(arm: &str, w: &Waits) -> String {
    let mut s = format!(
        "waits, arm {arm}, prefetch at {:?} ({} prefetches started), replay clock (speedup {}): queue and get MEASURED, prefill MODELLED / speedup, TTFT = their sum\n| requests | n | prefetched | queue p10 / p50 / p90 ms | placed-to-start p10 / p50 ms | get p50 / p90 ms | prefill p50 / p90 ms | TTFT p50 / p90 ms |\n|---|---|---|---|---|---|---|---|\n",
        w.prefetch_at, w.prefetched, w.speedup
    );
    for (name, g) in [
        ("hinted (a peer holds a longer prefix)", &w.hinted),
        ("  of which the get pulled", &w.get_pulled),
        ("  of which the get found all local", &w.hinted_local),
        ("local DRAM hit (not hinted)", &w.dram_hit),
        ("all", &w.all),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.2} / {:.2} | {:.1} / {:.1} | {:.1} / {:.1} |",
            g.n,
            g.prefetched,
            g.queue_ms.p10,
            g.queue_ms.p50,
            g.queue_ms.p90,
            g.placed_ms.p10,
            g.placed_ms.p50,
            g.get_ms.p50,
            g.get_ms.p90,
            g.prefill_ms.p50,
            g.prefill_ms.p90,
            g.ttft_ms.p50,
            g.ttft_ms.p90,
        );
    }
    s
}
