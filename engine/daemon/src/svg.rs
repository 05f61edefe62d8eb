//! Hand-written SVG of a latency report: one log2 distribution per op/tier/peer, then throughput.

use std::fmt::Write;

use kvnode_proto::obs::text::fmt_ns;
use kvnode_proto::obs::{LatencyHistogram, LatencyReport};

const W: f64 = 960.0;
const ROW: f64 = 110.0;
const LEFT: f64 = 170.0;
const PLOT_W: f64 = W - LEFT - 30.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// x position of `ns` on a log2 axis from 2^lo to 2^hi ns.
fn x_of(ns: f64, lo: u32, hi: u32) -> f64 {
    let l = ns.max(1.0).log2().clamp(f64::from(lo), f64::from(hi));
    LEFT + (l - f64::from(lo)) / f64::from(hi - lo) * PLOT_W
}

fn distribution(o: &mut String, h: &LatencyHistogram, y: f64, lo: u32, hi: u32) {
    let top = h.buckets.iter().map(|b| b.count).max().unwrap_or(1).max(1) as f64;
    let base = y + ROW - 30.0;
    let height = ROW - 45.0;
    let _ = writeln!(
        o,
        r#"<text x="10" y="{:.0}" class="name">{} {}</text><text x="10" y="{:.0}" class="small">n={} mean {}</text>"#,
        y + 30.0,
        esc(&h.group),
        esc(&h.name),
        y + 48.0,
        h.count,
        fmt_ns(h.mean_ns() as u64)
    );
    let _ = writeln!(
        o,
        r##"<line x1="{LEFT}" y1="{base}" x2="{}" y2="{base}" stroke="#888"/>"##,
        LEFT + PLOT_W
    );
    for b in &h.buckets {
        let (x0, x1) = (x_of(b.lo_ns as f64, lo, hi), x_of(b.hi_ns as f64, lo, hi));
        let bh = b.count as f64 / top * height;
        let _ = writeln!(
            o,
            r#"<rect class="bar" x="{x0:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}"><title>[{}, {}): {}</title></rect>"#,
            base - bh,
            (x1 - x0 - 1.0).max(1.0),
            fmt_ns(b.lo_ns),
            fmt_ns(b.hi_ns),
            b.count
        );
    }
    for (q, label, color) in [
        (0.5, "p50", "#2a7"),
        (0.99, "p99", "#d52"),
        (0.999, "p99.9", "#a2d"),
    ] {
        let v = h.quantile(q);
        let x = x_of(v as f64, lo, hi);
        let _ = writeln!(
            o,
            r#"<line x1="{x:.1}" y1="{:.0}" x2="{x:.1}" y2="{base}" stroke="{color}" stroke-dasharray="3,2"/><text x="{:.1}" y="{:.0}" class="small" fill="{color}">{label} {}</text>"#,
            y + 12.0,
            x + 3.0,
            y + 12.0
                + if label == "p50" {
                    0.0
                } else if label == "p99" {
                    11.0
                } else {
                    22.0
                },
            fmt_ns(v)
        );
    }
}

fn axis(o: &mut String, y: f64, lo: u32, hi: u32) {
    for p in (lo..=hi).step_by(2) {
        let x = x_of((1u64 << p) as f64, lo, hi);
        let _ = writeln!(
            o,
            r#"<text x="{x:.1}" y="{y:.0}" class="small" text-anchor="middle">{}</text>"#,
            fmt_ns(1u64 << p)
        );
    }
}

fn throughput(o: &mut String, r: &LatencyReport, y: f64) {
    let h = 160.0;
    let _ = writeln!(
        o,
        r#"<text x="10" y="{:.0}" class="name">Throughput over time (ops/s)</text>"#,
        y + 20.0
    );
    let pts = &r.timeline;
    if pts.is_empty() {
        let _ = writeln!(
            o,
            r#"<text x="{LEFT}" y="{:.0}" class="small">no samples</text>"#,
            y + 60.0
        );
        return;
    }
    let t_end = pts.iter().map(|p| p.t_s + p.dt_s).fold(0.0f64, f64::max);
    let t0 = pts[0].t_s;
    let rate = |p: &kvnode_proto::obs::TimelinePoint| p.ops as f64 / p.dt_s.max(1e-9);
    let top = pts.iter().map(rate).fold(0.0f64, f64::max).max(1.0);
    let base = y + 30.0 + h;
    let poly: Vec<String> = pts
        .iter()
        .map(|p| {
            let x = LEFT + (p.t_s + p.dt_s / 2.0 - t0) / (t_end - t0).max(1e-9) * PLOT_W;
            format!("{x:.1},{:.1}", base - rate(p) / top * h)
        })
        .collect();
    let _ = writeln!(
        o,
        r##"<line x1="{LEFT}" y1="{base}" x2="{}" y2="{base}" stroke="#888"/>"##,
        LEFT + PLOT_W
    );
    let _ = writeln!(o, r#"<polyline class="tput" points="{}"/>"#, poly.join(" "));
    let _ = writeln!(
        o,
        r#"<text x="{:.0}" y="{:.0}" class="small" text-anchor="end">{top:.0}/s</text>"#,
        LEFT - 5.0,
        y + 34.0
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.0}" y="{:.0}" class="small" text-anchor="end">0</text>"#,
        LEFT - 5.0,
        base
    );
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="{:.0}" class="small">{t0:.0}s</text><text x="{:.0}" y="{:.0}" class="small" text-anchor="end">{t_end:.0}s</text>"#,
        base + 14.0,
        LEFT + PLOT_W,
        base + 14.0
    );
}

/// The whole picture.
pub fn render(r: &LatencyReport) -> String {
    let (mut lo, mut hi) = (10u32, 20u32);
    for b in r.histograms.iter().flat_map(|h| &h.buckets) {
        lo = lo.min(b.lo_ns.max(1).ilog2());
        hi = hi.max(64 - b.hi_ns.saturating_sub(1).max(1).leading_zeros());
    }
    let rows = r.histograms.len() as f64;
    let height = 60.0 + rows * ROW + 30.0 + 230.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height:.0}" viewBox="0 0 {W} {height:.0}" font-family="sans-serif">"#
    );
    o.push_str("<style>.name{font-size:14px;font-weight:bold}.small{font-size:10px}.bar{fill:#4a7bd0}.tput{fill:none;stroke:#d07a2a;stroke-width:2}</style>\n");
    let _ = writeln!(o, r##"<rect width="100%" height="100%" fill="#fff"/>"##);
    let _ = writeln!(
        o,
        r#"<text x="10" y="24" font-size="18">kvnode latency report ({}, {:.1}s)</text>"#,
        esc(&r.source),
        r.duration_s
    );
    let _ = writeln!(
        o,
        r#"<text x="10" y="44" class="small">Latency distributions per op and tier (log2 buckets, log x axis)</text>"#
    );
    for (i, h) in r.histograms.iter().enumerate() {
        distribution(&mut o, h, 50.0 + i as f64 * ROW, lo, hi);
    }
    let axis_y = 50.0 + rows * ROW + 12.0;
    axis(&mut o, axis_y, lo, hi);
    throughput(&mut o, r, axis_y + 20.0);
    o.push_str("</svg>\n");
    o
}
