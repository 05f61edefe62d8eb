//! Observability vocabulary shared by the daemon, kvtrace and `kvnode report`.
//!
//! The numeric codes are the USDT probe arguments (docs/observability.md); the report types
//! are what the `histograms` op returns and what `kvtrace record` writes (JSON).

pub mod text;

/// The argument string of the daemon's `kvnode:op_done` USDT note on x86-64. Its probe sites
/// pass argument `i` in the `i`-th of `rdi rsi rdx rcx r8 r9 r10 r11`; when a daemon's note
/// says exactly this, kvtrace reads `op_done`'s arguments straight from those registers
/// instead of through the USDT argument spec (a lookup and a helper call per argument).
pub const OP_DONE_X86_ARGS: &str = "-8@%rdi -8@%rsi -8@%rdx -8@%rcx -8@%r8 -8@%r9 -8@%r10 -8@%r11";

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

macro_rules! codes {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $c:literal => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[repr(u32)]
        pub enum $name { $($(#[$vm])* $v = $c),+ }
        impl $name {
            /// Every value, in code order.
            pub const ALL: &'static [Self] = &[$(Self::$v),+];
            /// Lower-case name used in metrics labels, tables and files.
            pub fn name(self) -> &'static str { match self { $(Self::$v => $s),+ } }
            /// The probe argument.
            pub fn code(self) -> u32 { self as u32 }
            /// From a probe argument.
            pub fn from_code(c: u32) -> Option<Self> { match c { $($c => Some(Self::$v),)+ _ => None } }
        }
    };
}

codes!(
    /// A client operation (`op` argument of `op_start` / `op_done`).
    OpKind {
        /// Register a namespace.
        Register = 1 => "register",
        /// Put with inline bytes.
        Put = 2 => "put",
        /// Reserve slots.
        Alloc = 3 => "alloc",
        /// Publish reserved slots.
        Commit = 4 => "commit",
        /// Give reserved slots back.
        Abort = 5 => "abort",
        /// Get (inline or lease).
        Get = 6 => "get",
        /// End a lease.
        Release = 7 => "release",
        /// Count leading keys present.
        Exists = 8 => "exists",
        /// Remove keys.
        Delete = 9 => "delete",
        /// Remove a namespace's blocks.
        Clear = 10 => "clear",
        /// Statistics.
        Stats = 11 => "stats",
        /// Live latency histograms.
        Histograms = 12 => "histograms",
        /// A request whose header could not be decoded, or `Hello` after the handshake.
        Other = 13 => "other",
        /// Attach or detach client memory.
        Region = 14 => "region",
        /// Get into client memory.
        GetToRegion = 15 => "get_to_region",
        /// Put from client memory.
        PutFromRegion = 16 => "put_from_region",
        /// Attach a GPU buffer (CUDA IPC).
        AttachGpu = 17 => "attach_gpu",
        /// GPU pages into the DRAM tier.
        Offload = 18 => "offload",
        /// DRAM blocks into GPU pages (sync, async, wait, cancel).
        Onload = 19 => "onload",
        /// Start a hinted pull operation.
        Pull = 20 => "pull",
        /// Wait for a pull operation.
        Wait = 21 => "wait",
        /// Cancel a pull operation (the fence).
        Cancel = 22 => "cancel",
        /// Declared prefetch timeouts.
        Timeouts = 23 => "timeouts",
        /// Execute a router's hints envelope (prefetch, retain, release, demote, evict).
        Act = 24 => "act",
        /// Refresh blocks an engine holds on its GPU in the eviction policy.
        Touch = 25 => "touch",
    }
);

codes!(
    /// How an op ended (`status` argument of `op_done`).
    OpStatus {
        /// Every key succeeded.
        Ok = 0 => "ok",
        /// Some keys missed or were refused.
        Partial = 1 => "partial",
        /// The request was refused with an error reply.
        Error = 2 => "error",
        /// The connection failed mid-op.
        Io = 3 => "io",
    }
);

codes!(
    /// What stalled (`kind` argument of the `stall` probe).
    StallKind {
        /// A client op in flight longer than `op_deadline_s` (frozen or very slow client).
        OpDeadline = 1 => "op_deadline",
        /// Background arena pinning made no progress for `op_deadline_s`.
        PinStalled = 2 => "pin_stalled",
        /// The demotion (offload) queue is not draining.
        OffloadStalled = 3 => "offload_stalled",
        /// A peer stopped answering mid-pull.
        PeerStalled = 4 => "peer_stalled",
        /// A spill I/O did not complete in time.
        SpillIo = 5 => "spill_io",
    }
);

codes!(
    /// A tier (`tier` argument of `evict` and the tier histograms).
    TierCode {
        /// Pinned DRAM.
        Dram = 0 => "dram",
        /// NVMe spill.
        Nvme = 1 => "nvme",
        /// Peer daemons.
        Peer = 2 => "peer",
    }
);

/// One latency bucket: `count` samples in `[lo_ns, hi_ns)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Inclusive lower bound.
    pub lo_ns: u64,
    /// Exclusive upper bound.
    pub hi_ns: u64,
    /// Samples.
    pub count: u64,
}

/// A latency distribution of one op, tier or peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyHistogram {
    /// `op`, `tier`, `peer` or `uring`.
    pub group: String,
    /// Op name, `dram read`, peer address, ...
    pub name: String,
    /// Samples.
    pub count: u64,
    /// Sum of latencies.
    pub sum_ns: u64,
    /// Largest latency.
    pub max_ns: u64,
    /// Bytes moved by these samples.
    pub bytes: u64,
    /// Non-empty buckets, ascending.
    pub buckets: Vec<Bucket>,
    /// Exact percentiles where the source has them (`[quantile, ns]`; HDR in the daemon).
    pub percentiles: Vec<(f64, u64)>,
}

impl LatencyHistogram {
    /// Mean latency in ns (0 when empty).
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    /// The `q` quantile: exact when recorded, else interpolated inside its bucket.
    pub fn quantile(&self, q: f64) -> u64 {
        if let Some(&(_, v)) = self.percentiles.iter().find(|(p, _)| (p - q).abs() < 1e-9) {
            return v;
        }
        let total: u64 = self.buckets.iter().map(|b| b.count).sum();
        if total == 0 {
            return 0;
        }
        let rank = (q * total as f64).ceil().max(1.0);
        let mut seen = 0u64;
        for b in &self.buckets {
            if (seen + b.count) as f64 >= rank {
                let frac = (rank - seen as f64 - 0.5) / b.count as f64;
                let v = b.lo_ns as f64 + frac * (b.hi_ns - b.lo_ns) as f64;
                return (v as u64).min(if self.max_ns > 0 {
                    self.max_ns
                } else {
                    u64::MAX
                });
            }
            seen += b.count;
        }
        self.max_ns
    }
}

/// Ops and bytes completed in one interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// Interval start, seconds since the report's start.
    pub t_s: f64,
    /// Interval length in seconds.
    pub dt_s: f64,
    /// Ops completed.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// Latency histograms and throughput over time, from the daemon or from `kvtrace record`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyReport {
    /// `daemon` or `kvtrace`.
    pub source: String,
    /// Daemon pid(s).
    pub pids: Vec<u32>,
    /// Seconds covered.
    pub duration_s: f64,
    /// Distributions.
    pub histograms: Vec<LatencyHistogram>,
    /// Throughput over time.
    pub timeline: Vec<TimelinePoint>,
    /// Named counters (stalls, overdue leases, evictions, ...).
    pub counters: BTreeMap<String, u64>,
}

/// Log2 buckets `[2^i, 2^(i+1))` ns from a count per power of two (slot 0 also holds 0).
pub fn log2_buckets(slots: &[u64]) -> Vec<Bucket> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(i, &count)| Bucket {
            lo_ns: if i == 0 { 0 } else { 1u64 << i },
            hi_ns: 1u64.checked_shl(i as u32 + 1).unwrap_or(u64::MAX),
            count,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_names_are_unique() {
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(*k));
        }
        let mut names: Vec<_> = StallKind::ALL.iter().map(|k| k.name()).collect();
        names.dedup();
        assert_eq!(names.len(), StallKind::ALL.len());
    }

    #[test]
    fn quantile_interpolates_inside_log2_buckets() {
        let mut slots = [0u64; 64];
        slots[10] = 50; // [1024, 2048)
        slots[20] = 50; // [1 Mi, 2 Mi)
        let h = LatencyHistogram {
            buckets: log2_buckets(&slots),
            count: 100,
            max_ns: 1_900_000,
            ..LatencyHistogram::default()
        };
        assert!((1024..2048).contains(&h.quantile(0.5)));
        assert!((1 << 20..2 << 20).contains(&h.quantile(0.99)));
        assert!(h.quantile(1.0) <= 1_900_000);
    }
}
