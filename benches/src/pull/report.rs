//! The `kvnode bench pull` report: per-round lines, then the run's medians against the
//! same-round limits (memcpy, iperf3, the cold plain socket), as text and `--json`.

use hdrhistogram::Histogram;
use kvnode_proto::size::ByteSize;

use super::PullArgs;

pub(super) struct Results {
    pub(super) page: u64,
    pub(super) small: u64,
    pub(super) cold: f64,
    pub(super) lat: Histogram<u64>,
    /// The same-run floor under `lat` (`relay::floor`), sampled right after it.
    pub(super) floor: Histogram<u64>,
    /// The first throughput pull: the source hashes every block (later sends reuse the
    /// checksum kept with the block).
    pub(super) first: f64,
    pub(super) rounds: Vec<Round>,
    /// The big pull delivered into a client region, streamed and staged.
    pub(super) deliver: crate::deliver::Delivery,
    /// How the measured pulls' blocks moved, by the destination's counters.
    pub(super) moved: super::Moved,
}

/// One round: an iperf3 run, a memcpy of the same bytes, and the pulls right after them
/// (bytes per second).
pub(super) struct Round {
    pub(super) iperf: Option<f64>,
    /// `iperf3 -P connections` (only with more than one connection).
    pub(super) iperf_p: Option<f64>,
    /// CPU-s per GB: iperf3 one stream, `-P N`, and both daemons during the pulls.
    pub(super) iperf_cpu: Option<f64>,
    pub(super) iperf_p_cpu: Option<f64>,
    /// The plain-socket baseline with both sides as cold as the pull's (`socket::cold`),
    /// over as many connections as the pull uses.
    pub(super) sock: Option<crate::socket::Socket>,
    pub(super) pull_cpu: f64,
    pub(super) memcpy: f64,
    pub(super) pulls: Vec<f64>,
}

pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Per-round ratios against the same round's limits, as printed for each round.
#[derive(Default)]
struct RoundRatios {
    iperf: Vec<f64>,
    /// Pull against the cold socket: throughput, and CPU per GB.
    sock: Vec<f64>,
    sock_cpu: Vec<f64>,
    mem: Vec<f64>,
    iperf_p: Vec<f64>,
    cpu: Vec<f64>,
    cpu_ratio: Vec<f64>,
}

/// `m` against a round's `base` (bytes/s), when it was measured: the ratio is kept in
/// `ratios` and `label(percent, base GB/s)` is the text printed for it.
fn share(
    ratios: &mut Vec<f64>,
    m: f64,
    base: Option<f64>,
    label: impl FnOnce(f64, f64) -> String,
) -> String {
    base.map_or_else(String::new, |b| {
        ratios.push(m / b);
        label(m / b * 100.0, b / 1e9)
    })
}

/// Prints one line pair per round and collects the ratios.
fn report_rounds(a: &PullArgs, r: &Results) -> RoundRatios {
    let mut q = RoundRatios::default();
    let (ratios, mem, ratios_p, cpu, cpu_ratio) = (
        &mut q.iperf,
        &mut q.mem,
        &mut q.iperf_p,
        &mut q.cpu,
        &mut q.cpu_ratio,
    );
    for (i, x) in r.rounds.iter().enumerate() {
        let m = median(&x.pulls);
        mem.push(m / x.memcpy);
        cpu.push(x.pull_cpu);
        if let Some(ic) = x.iperf_p_cpu.or(x.iperf_cpu).filter(|c| *c > 0.0) {
            cpu_ratio.push(x.pull_cpu / ic);
        }
        let ip_p = share(ratios_p, m, x.iperf_p, |pct, gbps| {
            format!(
                "{pct:.0} % of iperf3 -P {} ({gbps:.2} GB/s), ",
                a.connections
            )
        });
        println!(
            "round {}: CPU-s per GB, both daemons {:.3}{}{}",
            i + 1,
            x.pull_cpu,
            x.iperf_cpu
                .map_or_else(String::new, |c| format!(", iperf3 one stream {c:.3}")),
            x.iperf_p_cpu.map_or_else(String::new, |c| format!(
                ", iperf3 -P {} {c:.3}",
                a.connections
            )),
        );
        if let Some(k) = x.sock {
            q.sock.push(m / k.bps);
            q.sock_cpu.push(x.pull_cpu / k.cpu_per_gb);
            println!(
                "round {}: cold plain socket ({} connection(s), {} pieces of a {} pool each side): {:.2} GB/s, {:.3} CPU-s per GB; pull = {:.0} % of it at {:.2} x its CPU per GB",
                i + 1,
                a.connections,
                ByteSize(r.page),
                ByteSize(r.page * a.pages as u64),
                k.bps / 1e9,
                k.cpu_per_gb,
                m / k.bps * 100.0,
                x.pull_cpu / k.cpu_per_gb
            );
        }
        let ip = share(ratios, m, x.iperf, |pct, gbps| {
            format!(
                "{pct:.0} % of iperf3 -c 127.0.0.1 -l 1M ({} s, {gbps:.2} GB/s), ",
                a.iperf_seconds
            )
        });
        println!(
            "round {}: {} pulls, median {:.2} GB/s = {ip}{ip_p}{:.0} % of memcpy ({:.2} GB/s)",
            i + 1,
            x.pulls.len(),
            m / 1e9,
            m / x.memcpy * 100.0,
            x.memcpy / 1e9
        );
    }
    q
}

/// The run's medians against its limits, printed as text and as JSON.
struct Summary {
    med: f64,
    best: f64,
    mem: f64,
    ips: Vec<f64>,
    ratio: Option<f64>,
    ratio_p: Option<f64>,
    cpu: f64,
    cpu_ratio: Option<f64>,
    /// Pull against the cold plain socket: throughput, CPU per GB.
    sock: Option<(f64, f64)>,
}

fn some_median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| median(v))
}

/// Median and best of every throughput pull of every round.
fn pulls(r: &Results) -> (f64, f64) {
    let all: Vec<f64> = r.rounds.iter().flat_map(|x| x.pulls.clone()).collect();
    (median(&all), all.iter().copied().fold(0.0, f64::max))
}

fn summarize(r: &Results, q: &RoundRatios) -> Summary {
    let (med, best) = pulls(r);
    Summary {
        med,
        best,
        mem: median(&q.mem),
        ips: r.rounds.iter().filter_map(|x| x.iperf).collect(),
        ratio: some_median(&q.iperf),
        ratio_p: some_median(&q.iperf_p),
        cpu: median(&q.cpu),
        cpu_ratio: some_median(&q.cpu_ratio),
        sock: some_median(&q.sock).zip(some_median(&q.sock_cpu)),
    }
}

/// Latency, first pull and delivery lines.
fn report_latency(a: &PullArgs, r: &Results) {
    let (small, h) = (ByteSize(r.small), &r.lat);
    let (med, best) = pulls(r);
    println!(
        "cold first pull (connect + auth + 1 x {small}): {:.3} ms",
        r.cold * 1e3
    );
    println!(
        "warm 1 x {small} pull latency (us): p50 {} p90 {} p99 {} max {}",
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.9),
        h.value_at_quantile(0.99),
        h.max()
    );
    let f = &r.floor;
    println!(
        "  floor, the same 4 socket hops with nothing else (client -> relay -> server -> relay -> client, {small} answer): p50 {} p90 {} us; pull p50 = {:.2} x floor",
        f.value_at_quantile(0.5),
        f.value_at_quantile(0.9),
        h.value_at_quantile(0.5) as f64 / f.value_at_quantile(0.5).max(1) as f64
    );
    println!("  {}", crate::relay::IdlePath::read().describe());
    println!(
        "{} x {} pull: median {:.2} GB/s, best {:.2} GB/s; first pull (source hashes each block) {:.2} GB/s",
        a.pages,
        ByteSize(r.page),
        med / 1e9,
        best / 1e9,
        r.first / 1e9
    );
    let dv = r.deliver;
    println!(
        "{} x {} into a client region, request to last page written: streamed (one hinted GetToRegion) {:.2} ms, of which the pull itself {:.2} ms; staged (hinted Get(Lease), then GetToRegion) {:.2} ms",
        a.pages,
        ByteSize(r.page),
        dv.streamed * 1e3,
        dv.streamed_pull * 1e3,
        dv.staged * 1e3
    );
}

/// The summary lines against memcpy, iperf3 and the cold socket.
fn report_ratios(a: &PullArgs, r: &Results, s: &Summary) {
    println!(
        "pull / same-round memcpy of the same {} x {} (one thread, cold): median {:.0} %",
        a.pages,
        ByteSize(r.page),
        s.mem * 100.0
    );
    if let Some(q) = s.ratio {
        let top = s.ips.iter().copied().fold(0.0, f64::max);
        println!(
            "pull / same-round iperf3: median {:.0} % (all pulls against the best iperf3 run: {:.0} %)",
            q * 100.0,
            s.med / top * 100.0
        );
    }
    if let Some(q) = s.ratio_p {
        println!(
            "pull / same-round iperf3 -P {}: median {:.0} %",
            a.connections,
            q * 100.0
        );
    }
    if let Some((t, c)) = s.sock {
        println!(
            "pull / same-round cold plain socket: median {:.0} % of its throughput, {:.2} x its CPU per GB",
            t * 100.0,
            c
        );
    }
    println!(
        "CPU-s per pulled GB (both daemons): median {:.3}{}",
        s.cpu,
        s.cpu_ratio
            .map_or_else(String::new, |q| format!(" = {q:.2} x same-round iperf3's"))
    );
}

fn json(a: &PullArgs, r: &Results, t: &kvnode_proto::pull::TimeoutReport, s: &Summary) -> String {
    let (h, dv) = (&r.lat, r.deliver);
    let idle = crate::relay::IdlePath::read();
    serde_json::json!({
        "cpuidle_driver": idle.driver, "guest_halt_poll_ns": idle.halt_poll_ns,
        "pages": a.pages, "page": r.page, "median_gbps": s.med / 1e9, "best_gbps": s.best / 1e9,
        "first_gbps": r.first / 1e9, "iperf3_gbps": s.ips.iter().map(|i| i / 1e9).collect::<Vec<_>>(),
        "ratio": s.ratio, "memcpy_ratio": s.mem, "cold_ms": r.cold * 1e3,
        "lat_p50_us": h.value_at_quantile(0.5), "lat_p90_us": h.value_at_quantile(0.9),
        "lat_p99_us": h.value_at_quantile(0.99), "lat_floor_p50_us": r.floor.value_at_quantile(0.5),
        "base_s": t.base_s, "per_page_s": t.per_page_s, "connections": a.connections,
        "ratio_p": s.ratio_p, "cpu_s_per_gb": s.cpu, "cpu_ratio": s.cpu_ratio,
        "sock_ratio": s.sock.map(|x| x.0), "sock_cpu_ratio": s.sock.map(|x| x.1),
        "deliver_streamed_ms": dv.streamed * 1e3, "deliver_streamed_pull_ms": dv.streamed_pull * 1e3,
        "deliver_staged_ms": dv.staged * 1e3, "transport": a.transport, "moved_by": r.moved.by(),
        "ucx_gets": r.moved.gets, "measured_blocks": r.moved.blocks, "ucx_fallbacks": r.moved.fallbacks,
    })
    .to_string()
}

/// Prints the whole report (and the JSON line with `--json`).
pub(super) fn report(a: &PullArgs, r: &Results, t: &kvnode_proto::pull::TimeoutReport) {
    report_latency(a, r);
    let q = report_rounds(a, r);
    let s = summarize(r, &q);
    report_ratios(a, r, &s);
    print!("{}", kvnode_client::report::render_timeouts(t));
    if a.json {
        println!("{}", json(a, r, t, &s));
    }
}
