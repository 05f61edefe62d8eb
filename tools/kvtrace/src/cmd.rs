//! The three commands: live latency tables, stall events, and recording to a file.

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvnode_proto::obs::text::{bars, fmt_ns, table};
use kvnode_proto::obs::{LatencyReport, OpKind, StallKind, TimelinePoint};
use libbpf_rs::RingBufferBuilder;

use crate::Target;
use crate::abi::{self, Event};
use crate::target;
use crate::tracer::{self, Options, Raw, Tracer};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn trap_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

fn pids(t: &Target) -> anyhow::Result<Vec<u32>> {
    target::preflight()?;
    if t.pid.is_empty() {
        return target::find_daemons();
    }
    for &p in &t.pid {
        target::check_pid(p)?;
    }
    Ok(t.pid.clone())
}

/// Runs `tick` every interval until the duration ends or a signal arrives.
fn run_loop(t: &Target, mut tick: impl FnMut(f64) -> anyhow::Result<()>) -> anyhow::Result<()> {
    trap_signals();
    let start = Instant::now();
    let end = t.duration.map(|d| start + Duration::from_secs_f64(d));
    let every = Duration::from_secs_f64(t.interval.max(0.01));
    let mut next = start + every;
    while !STOP.load(Ordering::Relaxed) && end.is_none_or(|e| Instant::now() < e) {
        let now = Instant::now();
        let wake = end.map_or(next, |e| next.min(e));
        if now < wake {
            std::thread::sleep((wake - now).min(Duration::from_millis(50)));
            continue;
        }
        if now >= next {
            tick(start.elapsed().as_secs_f64())?;
            next += every;
        }
    }
    Ok(())
}

fn attached(pids: &[u32]) {
    let list: Vec<String> = pids.iter().map(u32::to_string).collect();
    eprintln!("kvtrace: attached to kvnode pid {}", list.join(","));
}

fn export(
    h: &std::collections::BTreeMap<(String, String), Raw>,
) -> Vec<kvnode_proto::obs::LatencyHistogram> {
    h.iter().map(|((g, n), r)| r.export(g, n)).collect()
}

/// `kvtrace latency`.
pub fn latency(t: &Target, cumulative: bool, kernel_latency: bool) -> anyhow::Result<()> {
    let pids = pids(t)?;
    let mut storage = MaybeUninit::uninit();
    let opts = Options {
        probes: tracer::LATENCY,
        pair_ops: kernel_latency,
        ..Options::default()
    };
    let tr = Tracer::attach(&mut storage, &pids, opts)?;
    attached(&pids);
    let mut prev = tr.histograms();
    let mut last = 0.0;
    run_loop(t, |now| {
        let cur = tr.histograms();
        let shown: Vec<_> = if cumulative {
            export(&cur)
        } else {
            cur.iter()
                .map(|(k, r)| {
                    r.since(prev.get(k).copied().as_ref().unwrap_or(&Raw::default()))
                        .export(&k.0, &k.1)
                })
                .filter(|h| h.count > 0)
                .collect()
        };
        let secs = if cumulative { now } else { now - last };
        println!(
            "--- kvtrace latency: {:.1}s, {} ---",
            now,
            if cumulative {
                "since attach"
            } else {
                "last interval"
            }
        );
        if shown.is_empty() {
            println!("(no ops)");
        } else {
            print!("{}", table(&shown, secs));
            for h in shown.iter().filter(|h| h.group == "op") {
                print!("{}", bars(h, 40));
            }
        }
        prev = cur;
        last = now;
        Ok(())
    })?;
    println!("--- kvtrace latency: totals since attach ---");
    print!("{}", table(&export(&tr.histograms()), 0.0));
    Ok(())
}

fn describe(e: &Event) -> String {
    match e.kind {
        abi::EV_STALL => format!(
            "STALL {} pid={} id={} age={} detail={}",
            StallKind::from_code(e.a as u32).map_or("unknown", StallKind::name),
            e.tgid,
            e.b,
            fmt_ns(e.c),
            if e.a == u64::from(StallKind::OpDeadline.code()) {
                OpKind::from_code(e.d as u32)
                    .map_or_else(|| e.d.to_string(), |o| o.name().to_owned())
            } else {
                e.d.to_string()
            }
        ),
        abi::EV_LEASE => format!(
            "LEASE_OVERDUE pid={} conn={} lease={} pages={} age={}",
            e.tgid,
            e.b,
            e.d,
            e.e,
            fmt_ns(e.c)
        ),
        abi::EV_OP_SLOW => format!(
            "SLOW_OP {} pid={} conn={} req={} latency={} status={}",
            OpKind::from_code(e.a as u32).map_or("?", OpKind::name),
            e.tgid,
            e.b,
            e.d,
            fmt_ns(e.c),
            e.e
        ),
        abi::EV_URING_SLOW => format!(
            "SLOW_IO_URING pid={} req={:#x} latency={}",
            e.tgid,
            e.b,
            fmt_ns(e.c)
        ),
        k => format!("event kind {k}"),
    }
}

/// `kvtrace stalls`.
pub fn stalls(t: &Target, op_slow_ms: f64, uring_slow_us: f64) -> anyhow::Result<()> {
    let pids = pids(t)?;
    let mut storage = MaybeUninit::uninit();
    let op_slow_ns = (op_slow_ms * 1e6) as u64;
    let opts = Options {
        probes: if op_slow_ns > 0 {
            tracer::STALLS_SLOW_OPS
        } else {
            tracer::STALLS
        },
        op_slow_ns,
        uring_slow_ns: (uring_slow_us * 1e3) as u64,
        events: true,
        ..Options::default()
    };
    let tr = Tracer::attach(&mut storage, &pids, opts)?;
    attached(&pids);
    let mut rb = RingBufferBuilder::new();
    rb.add(&tr.skel.maps.events, |data: &[u8]| {
        if let Some(e) = Event::parse(data) {
            println!("{}", describe(&e));
        }
        0
    })?;
    let rb = rb.build()?;
    let poll = Target {
        interval: 0.05,
        ..t.clone()
    };
    run_loop(&poll, |_| {
        rb.poll(Duration::from_millis(0))
            .context("polling the event ring")?;
        Ok(())
    })?;
    rb.consume()?;
    let c = tr.counters();
    let get = |k: &str| c.get(k).copied().unwrap_or(0);
    println!(
        "kvtrace stalls: summary: stalls {} leases_overdue {} ops_slow {} uring_slow {} events_dropped {}",
        get("stalls"),
        get("leases_overdue"),
        get("ops_slow"),
        get("uring_slow"),
        get("events_dropped")
    );
    Ok(())
}

/// `kvtrace record --out FILE`.
pub fn record(t: &Target, out: &Path, kernel_latency: bool) -> anyhow::Result<()> {
    let pids = pids(t)?;
    let mut storage = MaybeUninit::uninit();
    let opts = Options {
        probes: tracer::RECORD,
        pair_ops: kernel_latency,
        ..Options::default()
    };
    let tr = Tracer::attach(&mut storage, &pids, opts)?;
    attached(&pids);
    let ops_total = |h: &std::collections::BTreeMap<(String, String), Raw>| {
        h.iter()
            .filter(|(k, _)| k.0 == "op")
            .fold((0, 0), |(o, b), (_, r)| (o + r.count, b + r.bytes))
    };
    let mut timeline: Vec<TimelinePoint> = Vec::new();
    let mut last = (0u64, 0u64);
    let start = Instant::now();
    let mut sample = |now: f64, timeline: &mut Vec<TimelinePoint>| {
        let t0 = timeline.last().map_or(0.0, |p| p.t_s + p.dt_s);
        if now - t0 < 1e-3 {
            return;
        }
        let cur = ops_total(&tr.histograms());
        timeline.push(TimelinePoint {
            t_s: t0,
            dt_s: now - t0,
            ops: cur.0 - last.0,
            bytes: cur.1 - last.1,
        });
        last = cur;
    };
    run_loop(t, |now| {
        sample(now, &mut timeline);
        Ok(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    sample(secs, &mut timeline);
    let hs = tr.histograms();
    let report = LatencyReport {
        source: "kvtrace".into(),
        pids: pids.clone(),
        duration_s: secs,
        histograms: export(&hs),
        timeline,
        counters: tr.counters(),
    };
    std::fs::write(out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", out.display()))?;
    print!("{}", table(&report.histograms, secs));
    eprintln!("kvtrace: recorded {:.1}s to {}", secs, out.display());
    Ok(())
}
