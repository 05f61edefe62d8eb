//! The live cost model: for each path the daemon moves bytes on, a fixed cost per operation
//! and a rate, fitted from what it actually moved and decayed so it follows the machine
//! (docs/fetch-plans.md).
//!
//! Each path keeps exponentially weighted sums of (bytes, seconds) samples; every new sample
//! scales the old ones by [`KEEP`] and by half per [`HALF_LIFE`] since the last one, so a
//! disk that becomes slow shows within a few operations. The figure is the weighted least
//! squares line `seconds = fixed + bytes / rate`; where the samples are all of one size (no
//! spread to separate the two terms), the whole time is counted as rate.
//!
//! The time-weighted sums follow a path that slows down within an operation or two (one slow
//! sample outweighs many fast ones) but one that becomes fast again only slowly: a disk
//! throttled for a while and then freed would stay slow for a dozen operations. So two
//! samples in a row [`SHIFT`] times faster than the figure predicts mean the machine changed,
//! and the fit restarts from the second. One fast sample alone changes nothing beyond its
//! weight: a lucky operation does not turn the plans back to a slow path.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvnode_proto::plan::{FetchPlan, PathCost, PlanReason, PlanStats};

/// Weight kept by the older samples when a new one comes (about the last 4 count).
pub const KEEP: f64 = 0.75;
/// Older samples lose half their weight per this much time (a figure left alone for the
/// plans' 30 s reprobe interval gives way to one new sample).
pub const HALF_LIFE: Duration = Duration::from_secs(10);

/// Two samples in a row this many times faster than the figure predicts restart the fit.
pub const SHIFT: f64 = 4.0;

/// A path's measured figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figure {
    /// Seconds per operation.
    pub fixed_s: f64,
    /// Bytes per second past the fixed cost.
    pub bytes_per_s: f64,
    /// Seconds since the last sample.
    pub age_s: f64,
}

impl Figure {
    /// Predicted seconds to move `bytes` in one operation.
    pub fn seconds(&self, bytes: u64) -> f64 {
        self.fixed_s + bytes as f64 / self.bytes_per_s
    }
}

#[derive(Debug, Clone)]
struct Fit {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    samples: u64,
    last: Instant,
    /// The last sample was [`SHIFT`] times faster than predicted.
    faster: bool,
}

impl Fit {
    fn new(now: Instant) -> Self {
        Self {
            w: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            samples: 0,
            last: now,
            faster: false,
        }
    }

    fn add(&mut self, bytes: f64, secs: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        let mut k = KEEP * 0.5f64.powf(dt / HALF_LIFE.as_secs_f64());
        let faster = self
            .figure(now)
            .is_some_and(|f| secs * SHIFT < f.fixed_s + bytes / f.bytes_per_s);
        if faster && self.faster {
            k = 0.0;
        }
        self.faster = faster;
        self.w = self.w * k + 1.0;
        self.sx = self.sx * k + bytes;
        self.sy = self.sy * k + secs;
        self.sxx = self.sxx * k + bytes * bytes;
        self.sxy = self.sxy * k + bytes * secs;
        self.samples += 1;
        self.last = now;
    }

    fn figure(&self, now: Instant) -> Option<Figure> {
        if self.samples == 0 || self.sx <= 0.0 {
            return None;
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let var = (self.sxx / self.w - mx * mx).max(0.0);
        let cov = self.sxy / self.w - mx * my;
        // A spread of sizes of at least a tenth of the mean separates fixed from rate.
        let (mut fixed, mut slope) = (0.0, my / mx);
        if var.sqrt() > 0.1 * mx && cov > 0.0 {
            let s = cov / var;
            let f = my - s * mx;
            if f >= 0.0 {
                (fixed, slope) = (f, s);
            }
        }
        (slope > 0.0).then(|| Figure {
            fixed_s: fixed,
            bytes_per_s: 1.0 / slope,
            age_s: now.saturating_duration_since(self.last).as_secs_f64(),
        })
    }
}

/// A busy period still busy after this long gives its sample and starts a new one.
pub const PERIOD_CUT: Duration = Duration::from_millis(250);

/// A path whose operations run side by side (NVMe promotion windows: a get's windows in
/// flight together, concurrent gets), measured as a whole: one sample per busy period,
/// every byte moved in it over its span. Timing each operation alone would charge each the
/// time they shared, and undercount the rate by the overlap. A period that stays busy is
/// cut every [`PERIOD_CUT`] (bytes of operations in flight across a cut count in the next
/// period).
#[derive(Debug, Default)]
pub struct Overlapped {
    busy: Mutex<Busy>,
}

#[derive(Debug, Default)]
struct Busy {
    in_flight: u32,
    since: Option<Instant>,
    bytes: u64,
}

impl Overlapped {
    fn busy(&self) -> std::sync::MutexGuard<'_, Busy> {
        self.busy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An operation starts.
    pub fn begin(&self) {
        self.begin_at(Instant::now());
    }

    /// An operation that moved `bytes` ended: the busy period's sample (bytes, span) when
    /// the period ends with it or is cut.
    pub fn end(&self, bytes: u64) -> Option<(u64, Duration)> {
        self.end_at(bytes, Instant::now())
    }

    fn begin_at(&self, now: Instant) {
        let mut b = self.busy();
        if b.in_flight == 0 {
            b.since = Some(now);
            b.bytes = 0;
        }
        b.in_flight += 1;
    }

    fn end_at(&self, bytes: u64, now: Instant) -> Option<(u64, Duration)> {
        let mut b = self.busy();
        b.in_flight = b.in_flight.saturating_sub(1);
        b.bytes += bytes;
        let span = now.saturating_duration_since(b.since?);
        if b.in_flight > 0 && span < PERIOD_CUT {
            return None;
        }
        let sample = (std::mem::take(&mut b.bytes), span);
        b.since = (b.in_flight > 0).then_some(now);
        Some(sample)
    }
}

/// Every path's fit, by name (`dram_copy`, `nvme_read`, `peer <addr> x<conns>`, ...).
#[derive(Debug, Default)]
pub struct PathCosts {
    fits: Mutex<BTreeMap<String, Fit>>,
}

/// The DRAM → client path over the socket.
pub const DRAM_COPY: &str = "dram_copy";
/// The DRAM → client region path (shared memory).
pub const DRAM_REGION: &str = "dram_region";
/// The DRAM → GPU path.
pub const DRAM_GPU: &str = "dram_gpu";
/// NVMe → DRAM promotion (a window of a get).
pub const NVME_READ: &str = "nvme_read";

/// The path name of pulls from `peer` striped over `conns` connections.
pub fn peer_path(peer: &str, conns: usize) -> String {
    format!("peer {peer} x{conns}")
}

impl PathCosts {
    fn fits(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Fit>> {
        self.fits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one operation that moved `bytes` in `took`.
    pub fn record(&self, path: &str, bytes: u64, took: Duration) {
        self.record_at(path, bytes, took, Instant::now());
    }

    /// [`PathCosts::record`] for a path every request takes (the DRAM reads): the sample is
    /// skipped when another thread holds the model, so requests never wait on it.
    pub fn record_hot(&self, path: &str, bytes: u64, took: Duration) {
        if let Ok(mut m) = self.fits.try_lock() {
            Self::add(&mut m, path, bytes, took, Instant::now());
        }
    }

    fn record_at(&self, path: &str, bytes: u64, took: Duration, now: Instant) {
        Self::add(&mut self.fits(), path, bytes, took, now);
    }

    fn add(m: &mut BTreeMap<String, Fit>, path: &str, bytes: u64, took: Duration, now: Instant) {
        if bytes == 0 {
            return;
        }
        let fit = match m.get_mut(path) {
            Some(f) => f,
            None => m.entry(path.to_owned()).or_insert_with(|| Fit::new(now)),
        };
        fit.add(bytes as f64, took.as_secs_f64(), now);
    }

    /// The figure of `path`, if it has been measured.
    pub fn figure(&self, path: &str) -> Option<Figure> {
        let m = self.fits();
        m.get(path).and_then(|f| f.figure(Instant::now()))
    }

    /// The figure of pulls from `peer` over `conns` connections, or else the one over the
    /// connection count measured most recently.
    pub fn peer_figure(&self, peer: &str, conns: usize) -> Option<Figure> {
        if let Some(f) = self.figure(&peer_path(peer, conns)) {
            return Some(f);
        }
        let prefix = format!("peer {peer} x");
        let now = Instant::now();
        let m = self.fits();
        m.range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .max_by_key(|(_, f)| f.last)
            .and_then(|(_, f)| f.figure(now))
    }

    /// Every measured path, for `stats.costs` and `/metrics`.
    pub fn report(&self) -> Vec<PathCost> {
        let now = Instant::now();
        let m = self.fits();
        m.iter()
            .filter_map(|(path, f)| {
                f.figure(now).map(|g| PathCost {
                    path: path.clone(),
                    fixed_s: g.fixed_s,
                    bytes_per_s: g.bytes_per_s,
                    samples: f.samples,
                    age_s: g.age_s,
                })
            })
            .collect()
    }
}

/// Fetch plans answered, by outcome (`stats.plans`, `kvnode_plans_total`).
#[derive(Debug, Default)]
pub struct PlanCounters {
    all: AtomicU64,
    slower: AtomicU64,
    probe: AtomicU64,
    nothing: AtomicU64,
    keys_fetch: AtomicU64,
    keys_recompute: AtomicU64,
    pulls_skipped: AtomicU64,
}

impl PlanCounters {
    /// Counts one plan answered.
    pub fn count(&self, p: &FetchPlan) {
        match p.reason {
            PlanReason::All => &self.all,
            PlanReason::Slower => &self.slower,
            PlanReason::Probe => &self.probe,
            PlanReason::Nothing => &self.nothing,
        }
        .fetch_add(1, Relaxed);
        self.keys_fetch.fetch_add(u64::from(p.keys), Relaxed);
        self.keys_recompute
            .fetch_add(u64::from(p.available.saturating_sub(p.keys)), Relaxed);
    }

    /// Counts a hinted lookup whose pull the plan left out.
    pub fn pull_skipped(&self) {
        self.pulls_skipped.fetch_add(1, Relaxed);
    }

    /// The counters as reported.
    pub fn report(&self) -> PlanStats {
        PlanStats {
            all: self.all.load(Relaxed),
            slower: self.slower.load(Relaxed),
            probe: self.probe.load(Relaxed),
            nothing: self.nothing.load(Relaxed),
            keys_fetch: self.keys_fetch.load(Relaxed),
            keys_recompute: self.keys_recompute.load(Relaxed),
            pulls_skipped: self.pulls_skipped.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// Four windows of 100 MB in flight together for 100 ms move 4 GB/s; timing each alone
    /// would say 1 GB/s.
    #[test]
    fn overlapping_operations_are_measured_as_one_busy_period() {
        let o = Overlapped::default();
        let t = Instant::now();
        for i in 0..4 {
            o.begin_at(t + secs(f64::from(i) * 0.001));
        }
        for i in 0..3 {
            assert_eq!(
                o.end_at(100 * MB, t + secs(0.097 + f64::from(i) * 0.001)),
                None
            );
        }
        let (bytes, span) = o.end_at(100 * MB, t + secs(0.1)).expect("the period ends");
        assert_eq!(bytes, 400 * MB);
        let rate = bytes as f64 / span.as_secs_f64();
        assert!(
            (rate / (4.0 * 100.0 * MB as f64 / 0.1) - 1.0).abs() < 1e-9,
            "{rate}"
        );
        // Sequential windows with gaps: each is a period of its own.
        let ms = Duration::from_millis;
        o.begin_at(t + ms(1000));
        assert_eq!(o.end_at(MB, t + ms(1010)), Some((MB, ms(10))));
        // A period that stays busy is cut.
        o.begin_at(t + ms(2000));
        o.begin_at(t + ms(2000));
        assert_eq!(o.end_at(MB, t + ms(2300)), Some((MB, ms(300))));
        assert_eq!(o.end_at(2 * MB, t + ms(2400)), Some((2 * MB, ms(100))));
    }

    #[test]
    fn sizes_that_differ_separate_the_fixed_cost_from_the_rate() {
        let c = PathCosts::default();
        let t = Instant::now();
        // 2 ms + 1 GB/s.
        for (i, mb) in [1u64, 8, 2, 16, 4, 32].iter().enumerate() {
            let b = mb * MB;
            c.record_at(
                "p",
                b,
                secs(0.002 + b as f64 / 1e9),
                t + secs(i as f64 * 0.01),
            );
        }
        let f = c.figure("p").expect("measured");
        assert!((f.fixed_s - 0.002).abs() < 1e-4, "{f:?}");
        assert!((f.bytes_per_s / 1e9 - 1.0).abs() < 0.01, "{f:?}");
    }

    #[test]
    fn one_size_counts_the_whole_time_as_rate() {
        let c = PathCosts::default();
        for _ in 0..3 {
            c.record("p", 4 * MB, secs(0.004));
        }
        let f = c.figure("p").expect("measured");
        assert!(f.fixed_s.abs() < f64::EPSILON, "{f:?}");
        assert!(
            (f.bytes_per_s - 4.0 * MB as f64 / 0.004).abs() < 1.0,
            "{f:?}"
        );
    }

    #[test]
    fn a_path_that_slows_down_shows_within_a_few_operations() {
        let c = PathCosts::default();
        let t = Instant::now();
        for i in 0..50 {
            c.record_at(
                "nvme_read",
                4 * MB,
                secs(0.004),
                t + secs(f64::from(i) * 0.01),
            );
        }
        // Now 50× slower: after 6 operations the figure is within 2× of the new rate.
        for i in 0..6 {
            c.record_at(
                "nvme_read",
                4 * MB,
                secs(0.2),
                t + secs(1.0 + f64::from(i) * 0.2),
            );
        }
        let rate = c.figure("nvme_read").expect("measured").bytes_per_s;
        let now = 4.0 * MB as f64 / 0.2;
        assert!(rate < 2.0 * now, "rate {rate} vs the new {now}");
    }

    #[test]
    fn old_samples_fade_with_time_so_a_recovered_path_shows_at_once() {
        let c = PathCosts::default();
        let t = Instant::now();
        for i in 0..50 {
            c.record_at("p", 4 * MB, secs(0.2), t + secs(f64::from(i) * 0.01));
        }
        // Ten minutes later one fast sample outweighs them.
        c.record_at("p", 4 * MB, secs(0.004), t + secs(600.0));
        let rate = c.figure("p").expect("measured").bytes_per_s;
        assert!(rate > 0.5 * (4.0 * MB as f64 / 0.004), "{rate}");
    }

    /// A disk throttled for a while, then freed, probed once a second (the plans' reprobe):
    /// the second fast probe in a row shows it, where the decay alone would take a dozen; the
    /// first alone does not.
    #[test]
    fn a_path_that_recovers_shows_at_its_second_fast_operation_in_a_row() {
        let c = PathCosts::default();
        let t = Instant::now();
        for i in 0..50 {
            c.record_at("p", 4 * MB, secs(0.004), t + secs(f64::from(i) * 0.01));
        }
        for i in 0..8 {
            c.record_at("p", 2 * MB, secs(0.5), t + secs(1.0 + f64::from(i) * 0.5));
        }
        let slow = c.figure("p").expect("measured").bytes_per_s;
        assert!(slow < 2.0 * (2.0 * MB as f64 / 0.5), "{slow}");
        let fast = MB as f64 / 0.001;
        c.record_at("p", MB, secs(0.001), t + secs(6.0));
        let rate = c.figure("p").expect("measured").bytes_per_s;
        assert!(rate < 0.1 * fast, "{rate} after one fast probe");
        c.record_at("p", MB, secs(0.001), t + secs(7.0));
        let rate = c.figure("p").expect("measured").bytes_per_s;
        assert!(rate > 0.9 * fast, "{rate} after two");
    }

    #[test]
    fn nothing_measured_is_no_figure_and_a_peer_falls_back_to_its_latest_connection_count() {
        let c = PathCosts::default();
        assert!(c.figure(NVME_READ).is_none());
        c.record(NVME_READ, 0, secs(1.0));
        assert!(
            c.figure(NVME_READ).is_none(),
            "an empty op measures nothing"
        );
        c.record(&peer_path("tcp://a:1", 1), MB, secs(0.01));
        c.record(&peer_path("tcp://a:1", 4), MB, secs(0.001));
        c.record(&peer_path("tcp://b:1", 4), MB, secs(1.0));
        let exact = c.peer_figure("tcp://a:1", 1).expect("x1");
        assert!((exact.bytes_per_s - MB as f64 / 0.01).abs() < 1.0);
        let other = c.peer_figure("tcp://a:1", 2).expect("falls back");
        assert!(
            (other.bytes_per_s - MB as f64 / 0.001).abs() < 1.0,
            "the latest: x4"
        );
        assert!(c.peer_figure("tcp://c:1", 1).is_none());
        assert_eq!(c.report().len(), 3);
    }
}
