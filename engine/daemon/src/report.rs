//! `kvnode report`: percentile tables, log2 bars and throughput from the daemon or a kvtrace file.

use std::fmt::Write;

use anyhow::Context;
use kvnode_client::Client;
use kvnode_proto::obs::LatencyReport;
use kvnode_proto::obs::text::{bars, fmt_bytes, table};

use crate::cli::ReportArgs;
use crate::keys;

/// Loads the report: `--from FILE` or the live daemon.
pub fn load(a: &ReportArgs) -> anyhow::Result<LatencyReport> {
    if let Some(f) = &a.from {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        return serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a kvtrace record / kvnode report JSON file",
                f.display()
            )
        });
    }
    let path = keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    Ok(c.histograms()?)
}

/// The terminal report.
pub fn render(r: &LatencyReport) -> String {
    let mut o = String::new();
    let pids: Vec<String> = r.pids.iter().map(u32::to_string).collect();
    let _ = writeln!(
        o,
        "kvnode latency report: source {} pid {} over {:.1}s",
        r.source,
        pids.join(","),
        r.duration_s
    );
    if r.histograms.is_empty() {
        let _ = writeln!(o, "\nno samples yet");
    } else {
        let _ = writeln!(o, "\nlatency percentiles");
        o.push_str(&table(&r.histograms, r.duration_s));
        let _ = writeln!(o, "\ndistributions (log2 buckets)");
        for h in &r.histograms {
            o.push_str(&bars(h, 40));
        }
    }
    let ops: u64 = r.timeline.iter().map(|p| p.ops).sum();
    let bytes: u64 = r.timeline.iter().map(|p| p.bytes).sum();
    let span: f64 = r.timeline.iter().map(|p| p.dt_s).sum();
    if span > 0.0 {
        let peak = r
            .timeline
            .iter()
            .map(|p| p.ops as f64 / p.dt_s.max(1e-9))
            .fold(0.0f64, f64::max);
        let _ = writeln!(
            o,
            "\nthroughput over {span:.0}s: {ops} ops ({:.1}/s mean, {peak:.1}/s peak), {} ({}/s)",
            ops as f64 / span,
            fmt_bytes(bytes),
            fmt_bytes((bytes as f64 / span) as u64)
        );
        let spark = ['.', ':', '-', '=', '+', '*', '#', '%', '@'];
        let top = r.timeline.iter().map(|p| p.ops).max().unwrap_or(1).max(1);
        let line: String = r
            .timeline
            .iter()
            .rev()
            .take(120)
            .rev()
            .map(|p| spark[(p.ops * 8 / top) as usize])
            .collect();
        let _ = writeln!(o, "  ops/interval: {line}");
    }
    let nonzero: Vec<_> = r.counters.iter().filter(|(_, v)| **v > 0).collect();
    if !nonzero.is_empty() {
        let _ = writeln!(o, "\ncounters");
        for (k, v) in nonzero {
            let _ = writeln!(o, "  {k:<28} {v}");
        }
    }
    o
}

/// Runs the command.
pub fn run(a: &ReportArgs) -> anyhow::Result<()> {
    let r = load(a)?;
    print!("{}", render(&r));
    if let Some(p) = &a.svg {
        std::fs::write(p, crate::svg::render(&r))
            .with_context(|| format!("writing {}", p.display()))?;
        println!("\nSVG written to {}", p.display());
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&r)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
