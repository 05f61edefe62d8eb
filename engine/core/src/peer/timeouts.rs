//! Pull latency histograms per (peer, page-size bucket) and the declared timeout model.
//!
//! Model (documented in docs/peer-protocol.md):
//! `base_s = max(BASE_FLOOR, MARGIN * max(first_p999 + connect_p999))`,
//! `per_page_s = max(PAGE_FLOOR, MARGIN * max(per_page_p999))`, maxima over every measured
//! (peer, page size); before any pull is measured, SGLang's defaults are declared.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use kvnode_proto::pull::{PullFigures, TimeoutReport};

/// Safety factor over the measured high percentiles.
pub const MARGIN: f64 = 2.0;
/// Smallest declared base, seconds.
pub const BASE_FLOOR_S: f64 = 0.05;
/// Smallest declared per-page time, seconds.
pub const PAGE_FLOOR_S: f64 = 0.001;
/// Base declared before any measurement (SGLang's `prefetch_timeout_base`).
pub const DEFAULT_BASE_S: f64 = 1.0;
/// Per page declared before any measurement (SGLang's 0.25 s per 1024 tokens, 64-token pages).
pub const DEFAULT_PER_PAGE_S: f64 = 0.25 * 64.0 / 1024.0;

#[derive(Debug)]
struct Hists {
    first: Histogram<u64>,
    per_page: Histogram<u64>,
    connect: Histogram<u64>,
}

fn hist() -> Histogram<u64> {
    // Microseconds, 1 µs .. 1 h, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn us(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, 3_600_000_000)
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1e3
    }
}

/// Measured pull latencies.
#[derive(Debug, Default)]
pub struct PullStats {
    by: Mutex<HashMap<(String, u64), Hists>>,
    connects: Mutex<HashMap<String, Histogram<u64>>>,
}

impl PullStats {
    /// Records one pull chunk: time to the first answer, and per further block.
    pub fn record(&self, peer: &str, page_bytes: u64, first: Duration, per_page: Option<Duration>) {
        let bucket = page_bytes.max(1).next_power_of_two();
        let mut m = self.by.lock().expect("stats lock");
        let h = m.entry((peer.to_owned(), bucket)).or_insert_with(|| Hists {
            first: hist(),
            per_page: hist(),
            connect: hist(),
        });
        h.first.saturating_record(us(first));
        if let Some(p) = per_page {
            h.per_page.saturating_record(us(p));
        }
    }

    /// Records a cold connection (connect + authentication).
    pub fn record_connect(&self, peer: &str, d: Duration) {
        let mut m = self.connects.lock().expect("stats lock");
        m.entry(peer.to_owned())
            .or_insert_with(hist)
            .saturating_record(us(d));
    }

    /// The declared model and its figures.
    pub fn report(&self) -> TimeoutReport {
        let by = self.by.lock().expect("stats lock");
        let connects = self.connects.lock().expect("stats lock");
        let mut figures: Vec<PullFigures> = Vec::new();
        let (mut base, mut page) = (0.0f64, 0.0f64);
        for ((peer, bytes), h) in by.iter() {
            let c = connects.get(peer).unwrap_or(&h.connect);
            base = base.max(ms(&h.first, 0.999) + ms(c, 0.999));
            page = page.max(ms(&h.per_page, 0.999));
            figures.push(PullFigures {
                peer: peer.clone(),
                page_bytes: *bytes,
                samples: h.first.len(),
                first_p50_ms: ms(&h.first, 0.5),
                first_p99_ms: ms(&h.first, 0.99),
                first_max_ms: h.first.max() as f64 / 1e3,
                per_page_p50_ms: ms(&h.per_page, 0.5),
                per_page_p99_ms: ms(&h.per_page, 0.99),
                connect_p99_ms: ms(c, 0.99),
            });
        }
        figures.sort_by(|a, b| (&a.peer, a.page_bytes).cmp(&(&b.peer, b.page_bytes)));
        let measured = !figures.is_empty();
        let formula = format!(
            "base_s = max({BASE_FLOOR_S}, {MARGIN} x max(first-answer p99.9 + connect p99.9)); per_page_s = max({PAGE_FLOOR_S}, {MARGIN} x max(per-page p99.9)); maxima over peers and page sizes; defaults {DEFAULT_BASE_S} s + {DEFAULT_PER_PAGE_S} s/page until measured"
        );
        let (base_s, per_page_s) = if measured {
            (
                (MARGIN * base / 1e3).max(BASE_FLOOR_S),
                (MARGIN * page / 1e3).max(PAGE_FLOOR_S),
            )
        } else {
            (DEFAULT_BASE_S, DEFAULT_PER_PAGE_S)
        };
        TimeoutReport {
            base_s,
            per_page_s,
            formula,
            measured,
            figures,
        }
    }

    /// The declared wait for `pages` pages.
    pub fn deadline(&self, pages: usize) -> Duration {
        let r = self.report();
        Duration::from_secs_f64(r.base_s + r.per_page_s * pages as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_model_covers_the_measured_tail_with_margin_and_floors() {
        let s = PullStats::default();
        let r0 = s.report();
        assert!(!r0.measured);
        assert!((r0.base_s - DEFAULT_BASE_S).abs() < 1e-9);
        for i in 0..1000u64 {
            s.record(
                "tcp://a:1",
                1 << 20,
                Duration::from_micros(200 + i),
                Some(Duration::from_micros(500)),
            );
        }
        s.record("tcp://a:1", 1 << 20, Duration::from_millis(40), None);
        s.record_connect("tcp://a:1", Duration::from_millis(3));
        let r = s.report();
        assert!(r.measured);
        // p99.9 of first lands on the 40 ms outlier or just under; connect adds 3 ms.
        assert!(
            r.base_s >= 2.0 * (0.001 + 0.003) && r.base_s <= 2.0 * 0.0431,
            "{r:?}"
        );
        assert!((r.per_page_s - PAGE_FLOOR_S).abs() < 1e-3, "{r:?}");
        assert_eq!(r.figures[0].samples, 1001);
        assert!(s.deadline(10) > Duration::from_secs_f64(r.base_s));
    }
}
