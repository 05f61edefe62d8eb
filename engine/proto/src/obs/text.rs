//! Terminal rendering of latency histograms: percentile tables and log2 bars (kvtrace, kvnode report).

use std::fmt::Write;

use super::LatencyHistogram;

/// `950ns`, `12.3us`, `4.56ms`, `1.20s`.
pub fn fmt_ns(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", v / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", v / 1e6)
    } else {
        format!("{:.2}s", v / 1e9)
    }
}

/// `512B`, `3.2MB`, `1.50GB` (decimal).
pub fn fmt_bytes(b: u64) -> String {
    let v = b as f64;
    if b < 1_000 {
        format!("{b}B")
    } else if b < 1_000_000 {
        format!("{:.1}kB", v / 1e3)
    } else if b < 1_000_000_000 {
        format!("{:.1}MB", v / 1e6)
    } else {
        format!("{:.2}GB", v / 1e9)
    }
}

/// The quantiles every table shows.
pub const TABLE_QUANTILES: [(f64, &str); 4] =
    [(0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (0.999, "p99.9")];

/// A percentile table, one row per histogram; `secs` > 0 adds a rate column.
pub fn table(hs: &[LatencyHistogram], secs: f64) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "{:<6} {:<14} {:>10} {:>10} {:>9}",
        "group", "name", "count", "rate/s", "mean"
    );
    for (_, n) in TABLE_QUANTILES {
        let _ = write!(o, " {n:>9}");
    }
    let _ = writeln!(o, " {:>9} {:>9}", "max", "bytes");
    for h in hs {
        let rate = if secs > 0.0 {
            h.count as f64 / secs
        } else {
            0.0
        };
        let _ = write!(
            o,
            "{:<6} {:<14} {:>10} {:>10.1} {:>9}",
            h.group,
            h.name,
            h.count,
            rate,
            fmt_ns(h.mean_ns() as u64)
        );
        for (q, _) in TABLE_QUANTILES {
            let _ = write!(o, " {:>9}", fmt_ns(h.quantile(q)));
        }
        let _ = writeln!(o, " {:>9} {:>9}", fmt_ns(h.max_ns), fmt_bytes(h.bytes));
    }
    o
}

/// One bar per non-empty log2 bucket, `width` characters for the fullest.
pub fn bars(h: &LatencyHistogram, width: usize) -> String {
    let top = h.buckets.iter().map(|b| b.count).max().unwrap_or(0).max(1);
    let mut o = String::new();
    let _ = writeln!(o, "{} {} ({} samples)", h.group, h.name, h.count);
    for b in &h.buckets {
        let n = ((b.count as f64 / top as f64) * width as f64).ceil() as usize;
        let _ = writeln!(
            o,
            "  [{:>8}, {:>8}) {:<width$} {}",
            fmt_ns(b.lo_ns),
            fmt_ns(b.hi_ns),
            "#".repeat(n),
            b.count
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::obs::log2_buckets;

    #[test]
    fn table_and_bars_show_counts_and_percentiles() {
        let mut slots = [0u64; 64];
        slots[12] = 30;
        slots[14] = 10;
        let h = LatencyHistogram {
            group: "op".into(),
            name: "get".into(),
            count: 40,
            sum_ns: 40 * 6000,
            max_ns: 20_000,
            bytes: 4_000_000,
            buckets: log2_buckets(&slots),
            percentiles: vec![],
        };
        let t = table(std::slice::from_ref(&h), 2.0);
        assert!(t.contains("p99.9") && t.contains("get"), "{t}");
        assert!(
            t.contains(" 40 ") && t.contains("20.0") && t.contains("4.0MB"),
            "{t}"
        );
        let b = bars(&h, 20);
        assert!(
            b.contains(&"#".repeat(20)) && b.contains("[   4.1us,    8.2us)"),
            "{b}"
        );
        assert_eq!(fmt_ns(1_500_000), "1.50ms");
    }
}
