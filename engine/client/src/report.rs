//! Text rendering of daemon reports shared by the CLI and the benchmarks.

use std::fmt::Write;

use kvnode_proto::pull::TimeoutReport;
use kvnode_proto::size::ByteSize;

/// Renders the declared prefetch timeouts and the pull latencies behind them.
pub fn render_timeouts(t: &TimeoutReport) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nprefetch timeout: base_s {:.3} + per_page_s {:.4} x pages ({})",
        t.base_s,
        t.per_page_s,
        if t.measured {
            "measured"
        } else {
            "defaults: no pull measured yet"
        }
    );
    if !t.figures.is_empty() {
        let _ = writeln!(
            o,
            "{:<28} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "peer",
            "page",
            "pulls",
            "first p50",
            "first p99",
            "first max",
            "page p50",
            "page p99",
            "conn p99"
        );
    }
    for f in &t.figures {
        let _ = writeln!(
            o,
            "{:<28} {:>10} {:>8} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            f.peer,
            ByteSize(f.page_bytes).to_string(),
            f.samples,
            f.first_p50_ms,
            f.first_p99_ms,
            f.first_max_ms,
            f.per_page_p50_ms,
            f.per_page_p99_ms,
            f.connect_p99_ms
        );
    }
    let _ = writeln!(o, "formula: {}", t.formula);
    o
}
