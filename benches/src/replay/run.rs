//! `kvnode bench replay`: loads the trace slice, computes the offline optimum, runs each arm
//! against daemons it starts, and prints the table (and `--json`, `--svg`).

use std::time::Instant;

use anyhow::Context;
use kvnode_client::Client;

use super::config::{Arm, ReplayArgs, Setup};
use super::cost::CostModel;
use super::drive::{Live, Record};
use super::report::{self, ArmRun, ArmSummary, DaemonCounters, Offline};
use super::trace::{self, Request};
use super::{events, fleet, offline, svg, waits};

/// The offline figures beside every arm: the ceiling, Belady's MIN with the fleet's DRAM as
/// one cache, and the daemon's policy as one cache of one node's DRAM.
pub fn offline_figures(setup: &Setup, trace: &[Request]) -> Offline {
    let fleet_blocks = setup.dram_blocks * setup.nodes;
    Offline {
        ceiling: offline::ceiling(trace).hit_rate(),
        belady_hit_rate: offline::belady(trace, fleet_blocks).hit_rate(),
        belady_blocks: fleet_blocks,
        policy_hit_rate: offline::simulate(trace, setup.dram_blocks, setup.policy).hit_rate(),
    }
}

/// Replays `trace` in `arm` against daemons started for it; returns the per-request records,
/// the daemons' counters and the wall time.
pub fn replay_arm(
    a: &ReplayArgs,
    setup: &Setup,
    arm: Arm,
    trace: &[Request],
) -> anyhow::Result<(Vec<Record>, DaemonCounters, f64)> {
    if a.model {
        let t = Instant::now();
        let recs = super::model::run(setup, arm, trace)
            .into_iter()
            .map(|(engine, served)| Record {
                engine,
                served,
                timing: super::engine::Timing::default(),
            })
            .collect();
        return Ok((recs, DaemonCounters::default(), t.elapsed().as_secs_f64()));
    }
    let daemons = fleet::start(setup, arm, &a.policy)?;
    let endpoints: Vec<String> = daemons.iter().map(|d| d.events.clone()).collect();
    let subs = events::start(&endpoints)?;
    let live = Live {
        setup,
        arm,
        daemons: &daemons,
        subs: &subs,
        prefetch_at: a.prefetch_at,
        hold: a.hold_prefill.then_some(super::engine::Hold {
            cost: CostModel::default(),
            speedup: a.speedup,
        }),
    };
    let t = Instant::now();
    let recs = if a.deterministic {
        live.deterministic(trace)
    } else {
        live.timed(trace, a.speedup, a.in_flight)
    }
    .with_context(|| format!("replaying arm {arm:?}"))?;
    let wall = t.elapsed().as_secs_f64();
    let mut counters = DaemonCounters::default();
    for d in &daemons {
        let st = Client::connect(&d.sock)?.stats()?;
        if let Some(t) = st.tiers.first() {
            counters.add(t);
        }
        if d.router.is_some() {
            counters.router.push(st.router);
        }
    }
    Ok((recs, counters, wall))
}

/// Runs the benchmark.
pub fn run(a: &ReplayArgs) -> anyhow::Result<()> {
    let setup = Setup::of(a)?;
    let trace = trace::load(&a.trace, a.requests)?;
    let off = offline_figures(&setup, &trace);
    let cost = CostModel::default();
    println!(
        "kvnode bench replay: {} ({} requests), {} nodes x {} engines, DRAM {} blocks/node, GPU {} blocks/engine, policy {}, placement {:?}, {}",
        a.trace.display(),
        trace.len(),
        setup.nodes,
        setup.engines_per_node,
        setup.dram_blocks,
        setup.gpu_blocks,
        a.policy,
        setup.placement,
        if a.model {
            "MODEL of the deterministic replay (no daemons)".to_owned()
        } else if a.deterministic {
            "deterministic (one request at a time)".to_owned()
        } else {
            format!(
                "speedup {}x, {} in flight per engine, prefetch at {:?}{}",
                a.speedup,
                a.in_flight,
                a.prefetch_at,
                if a.hold_prefill {
                    ", engines held for the MODELLED prefill / speedup"
                } else {
                    ""
                }
            )
        }
    );
    println!(
        "scale: a 512-token block is one {}-byte kvnode page (the cost model's engine: {} MiB); hit rates and bytes are counted from the daemons' answers; TTFT and req/s are a MODEL",
        setup.block_bytes,
        cost.kv_bytes_per_token * 512.0 / f64::from(1 << 20)
    );
    let mut arms: Vec<ArmSummary> = Vec::new();
    for &arm in &a.arm {
        let (recs, daemon, wall_s) = replay_arm(a, &setup, arm, &trace)?;
        let mut s = report::summarize(
            &ArmRun {
                setup: &setup,
                arm,
                trace: &trace,
                recs: &recs,
                offline: off,
                daemon,
                wall_s,
            },
            &cost,
        );
        if a.hold_prefill && !a.model {
            let w = waits::of(&trace, &recs, &cost, a.speedup, a.prefetch_at);
            print!("{}", waits::table(&format!("{arm:?}"), &w));
            s.waits = Some(w);
        }
        print!("{}", s.daemon.router_lines());
        if a.json {
            println!("{}", serde_json::to_string(&s)?);
        }
        arms.push(s);
    }
    print!("{}", report::table(&arms));
    if a.json {
        let run = serde_json::json!({
            "trace": a.trace.display().to_string(),
            "requests": trace.len(),
            "setup": setup,
            "deterministic": a.deterministic,
            "speedup": a.speedup,
            "in_flight": a.in_flight,
            "prefetch_at": a.prefetch_at,
            "hold_prefill": a.hold_prefill,
            "cost_model": cost,
            "arms": arms,
        });
        println!("{run}");
    }
    if let Some(p) = &a.svg {
        let title = format!(
            "{}, {} req, {}x{} engines, {} DRAM blocks/node, {:?}, {}",
            a.trace.file_name().unwrap_or_default().to_string_lossy(),
            trace.len(),
            setup.nodes,
            setup.engines_per_node,
            setup.dram_blocks,
            setup.placement,
            a.policy
        );
        std::fs::write(p, svg::render(&title, &arms))
            .with_context(|| format!("{}", p.display()))?;
    }
    Ok(())
}
