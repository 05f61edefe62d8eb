//! One HDR latency histogram with byte and sum counters, and the per-second throughput log.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use hdrhistogram::Histogram;
use kvnode_proto::obs::{LatencyHistogram, TimelinePoint, log2_buckets};

/// Quantiles reported exactly from HDR.
pub const QUANTILES: [f64; 5] = [0.5, 0.9, 0.99, 0.999, 1.0];
/// Longest latency recorded without saturating: one hour.
const MAX_NS: u64 = 3_600_000_000_000;
/// Seconds of throughput history kept.
const TIMELINE_S: usize = 3600;

/// An HDR histogram of nanoseconds (2 significant digits) plus exact sum and bytes.
#[derive(Debug)]
pub struct Hist {
    h: Mutex<Histogram<u64>>,
    sum_ns: AtomicU64,
    bytes: AtomicU64,
}

impl Default for Hist {
    fn default() -> Self {
        Self {
            h: Mutex::new(Histogram::new_with_bounds(1, MAX_NS, 2).expect("valid HDR bounds")),
            sum_ns: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }
}

impl Hist {
    /// Records one sample.
    pub fn record(&self, ns: u64, bytes: u64) {
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.lock().saturating_record(ns.max(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Histogram<u64>> {
        // A panic while recording leaves the histogram usable: counts are plain integers.
        self.h
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Samples so far.
    pub fn count(&self) -> u64 {
        self.lock().len()
    }

    /// Counts per power of two of ns: slot i holds samples in `[2^i, 2^(i+1))`.
    pub fn log2_slots(&self) -> [u64; 64] {
        let h = self.lock();
        let mut slots = [0u64; 64];
        for v in h.iter_recorded() {
            let lo = h.lowest_equivalent(v.value_iterated_to()).max(1);
            slots[lo.ilog2() as usize] += v.count_at_value();
        }
        slots
    }

    /// The report form.
    pub fn export(&self, group: &str, name: &str) -> LatencyHistogram {
        let slots = self.log2_slots();
        let h = self.lock();
        LatencyHistogram {
            group: group.into(),
            name: name.into(),
            count: h.len(),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            max_ns: h.max(),
            bytes: self.bytes.load(Ordering::Relaxed),
            buckets: log2_buckets(&slots),
            percentiles: QUANTILES
                .iter()
                .map(|&q| (q, h.value_at_quantile(q)))
                .collect(),
        }
    }

    /// Sum of latencies in ns.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns.load(Ordering::Relaxed)
    }
}

/// Ops and bytes per second since start, for the last hour.
#[derive(Debug, Default)]
pub struct Timeline {
    secs: Mutex<VecDeque<(u64, u64, u64)>>,
}

impl Timeline {
    /// Adds one op of `bytes` completed `sec` seconds after start.
    pub fn add(&self, sec: u64, bytes: u64) {
        let mut q = self
            .secs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match q.back_mut() {
            Some(b) if b.0 == sec => {
                b.1 += 1;
                b.2 += bytes;
            }
            _ => {
                q.push_back((sec, 1, bytes));
                while q.len() > TIMELINE_S {
                    q.pop_front();
                }
            }
        }
    }

    /// One point per second from the first recorded second to `now_s` (gaps are zero).
    pub fn points(&self, now_s: u64) -> Vec<TimelinePoint> {
        let q = self
            .secs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(first) = q.front().map(|b| b.0) else {
            return Vec::new();
        };
        let mut it = q.iter().peekable();
        (first..=now_s.max(first))
            .map(|s| {
                let (ops, bytes) = match it.peek() {
                    Some(b) if b.0 == s => {
                        let b = it.next().expect("peeked");
                        (b.1, b.2)
                    }
                    _ => (0, 0),
                };
                TimelinePoint {
                    t_s: s as f64,
                    dt_s: 1.0,
                    ops,
                    bytes,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log2_slots_put_each_sample_in_its_power_of_two() {
        let h = Hist::default();
        for ns in [1, 1000, 1023, 1024, 5_000_000] {
            h.record(ns, 10);
        }
        let s = h.log2_slots();
        assert_eq!(s[0], 1);
        assert_eq!(s[9], 2);
        assert_eq!(s[10], 1);
        assert_eq!(s[22], 1);
        let e = h.export("op", "get");
        assert_eq!((e.count, e.bytes, e.sum_ns), (5, 50, 5_003_048));
        assert_eq!(e.buckets.iter().map(|b| b.count).sum::<u64>(), 5);
    }

    #[test]
    fn timeline_fills_gaps_with_zero() {
        let t = Timeline::default();
        t.add(3, 100);
        t.add(3, 50);
        t.add(5, 1);
        let p = t.points(6);
        let ops: Vec<u64> = p.iter().map(|p| p.ops).collect();
        assert_eq!(ops, vec![2, 0, 1, 0]);
        assert_eq!(p[0].bytes, 150);
    }
}
