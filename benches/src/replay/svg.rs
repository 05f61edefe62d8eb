//! The replay's chart, in the style of docs/ttft.svg: per arm, the hit rate stacked by tier
//! (GPU, node DRAM, peer) against the ceiling and Belady's MIN, and the modelled TTFT
//! percentiles.

use std::fmt::Write;

use super::report::ArmSummary;

const W: f64 = 900.0;
const LEFT: f64 = 170.0;
const BAR: f64 = 600.0;

fn rect(s: &mut String, x: f64, y: f64, w: f64, h: f64, fill: &str) {
    let _ = writeln!(
        s,
        r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}"/>"#
    );
}

fn text(s: &mut String, x: f64, y: f64, t: &str) {
    let _ = writeln!(s, r#"<text x="{x:.1}" y="{y:.1}">{t}</text>"#);
}

fn legend(s: &mut String, y: f64, items: &[(&str, &str)]) {
    for (i, (name, color)) in items.iter().enumerate() {
        let x = 560.0 + i as f64 * 85.0;
        rect(s, x, y - 11.0, 12.0, 12.0, color);
        text(s, x + 16.0, y, name);
    }
}

/// The SVG of a run's arms; `title` names the trace and setup.
pub fn render(title: &str, arms: &[ArmSummary]) -> String {
    let row = 44.0;
    let hit_h = 40.0 + arms.len() as f64 * row;
    let h = 2.0 * hit_h + 40.0;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="{W}" height="{h}" fill="white"/>
"#
    );
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="14">Hit rate by tier (measured) — {title}</text>"#
    );
    legend(
        &mut s,
        36.0,
        &[("GPU", "#1f77b4"), ("DRAM", "#2ca02c"), ("peer", "#ff7f0e")],
    );
    for (i, a) in arms.iter().enumerate() {
        let y = 50.0 + i as f64 * row;
        text(&mut s, 10.0, y + 14.0, &format!("{:?}", a.arm));
        let mut x = LEFT;
        for (v, c) in [
            (a.hit_rate_gpu, "#1f77b4"),
            (a.hit_rate_dram, "#2ca02c"),
            (a.hit_rate_peer, "#ff7f0e"),
        ] {
            rect(&mut s, x, y, v * BAR, 20.0, c);
            x += v * BAR;
        }
        text(&mut s, x + 4.0, y + 14.0, &format!("{:.3}", a.hit_rate));
        for (v, c) in [
            (a.offline.ceiling, "#000"),
            (a.offline.belady_hit_rate, "#d62728"),
        ] {
            let lx = LEFT + v * BAR;
            let _ = writeln!(
                s,
                r#"<line x1="{lx:.1}" y1="{:.1}" x2="{lx:.1}" y2="{:.1}" stroke="{c}" stroke-width="2"/>"#,
                y - 3.0,
                y + 23.0
            );
        }
    }
    let _ = writeln!(
        s,
        r##"<text x="10" y="{:.1}" fill="#555">black line: ceiling (infinite cache); red line: Belady's MIN with the fleet's DRAM</text>"##,
        hit_h + 8.0
    );
    ttft(&mut s, hit_h + 30.0, arms);
    s.push_str("</svg>\n");
    s
}

fn ttft(s: &mut String, top: f64, arms: &[ArmSummary]) {
    let _ = writeln!(
        s,
        r#"<text x="10" y="{top:.1}" font-size="14">TTFT (MODEL: docs/ttft.md prefill fit + path costs), ms: p50 / p90 / p99</text>"#
    );
    legend(
        s,
        top + 16.0,
        &[("p50", "#1f77b4"), ("p90", "#ff7f0e"), ("p99", "#d62728")],
    );
    let max = arms.iter().map(|a| a.ttft_model_ms.p99).fold(1.0, f64::max);
    for (i, a) in arms.iter().enumerate() {
        let y = top + 30.0 + i as f64 * 44.0;
        text(s, 10.0, y + 20.0, &format!("{:?}", a.arm));
        let t = a.ttft_model_ms;
        for (j, (v, c)) in [(t.p50, "#1f77b4"), (t.p90, "#ff7f0e"), (t.p99, "#d62728")]
            .into_iter()
            .enumerate()
        {
            let yy = y + j as f64 * 13.0;
            rect(s, LEFT, yy, v / max * BAR, 12.0, c);
            text(s, LEFT + v / max * BAR + 4.0, yy + 11.0, &format!("{v:.0}"));
        }
    }
}
