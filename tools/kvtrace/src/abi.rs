//! `#[repr(C)]` mirrors of `ebpf/kvtrace.h` (the map key/value types come from the skeleton).

pub use crate::skel::types::{kvt_hist, kvt_hist_key};

/// Op histograms per daemon in `op_hists` (`KVT_OPS` in `kvtrace.h`).
pub const KVT_OPS: u32 = 16;

/// `kind` values of [`kvt_hist_key`].
pub const KVT_OP: u32 = 1;
pub const KVT_SPILL: u32 = 2;
pub const KVT_PEER: u32 = 3;
pub const KVT_URING: u32 = 4;
pub const KVT_PROMOTE: u32 = 5;

/// `kind` values of [`Event`].
pub const EV_STALL: u32 = 1;
pub const EV_LEASE: u32 = 2;
pub const EV_OP_SLOW: u32 = 3;
pub const EV_URING_SLOW: u32 = 4;

/// Counter indexes and their names in reports.
pub const COUNTERS: [(u32, &str); 11] = [
    (0, "unmatched_op_done"),
    (1, "evictions"),
    (2, "evicted_bytes"),
    (3, "leases_overdue"),
    (4, "stalls"),
    (5, "events_dropped"),
    (6, "demotions"),
    (7, "cancels"),
    (8, "fences"),
    (9, "uring_slow"),
    (10, "ops_slow"),
];

/// One ring-buffer record (`struct kvt_event`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Event {
    pub kind: u32,
    pub tgid: u32,
    pub ts_ns: u64,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub e: u64,
}

impl Event {
    /// Parses a ring-buffer record (`None` if short).
    pub fn parse(data: &[u8]) -> Option<Self> {
        if data.len() < size_of::<Self>() {
            return None;
        }
        // SAFETY: length checked; Event is plain integers, any bit pattern is valid.
        Some(unsafe { std::ptr::read_unaligned(data.as_ptr().cast::<Self>()) })
    }
}

/// Reads a map value as `T` (plain-integer `repr(C)` types only).
pub fn from_bytes<T: Copy + Default>(data: &[u8]) -> T {
    if data.len() < size_of::<T>() {
        return T::default();
    }
    // SAFETY: length checked; callers use only plain-integer repr(C) types.
    unsafe { std::ptr::read_unaligned(data.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_header() {
        assert_eq!(size_of::<Event>(), 56);
        assert_eq!(size_of::<kvt_hist_key>(), 16);
        assert_eq!(size_of::<kvt_hist>(), 68 * 8);
    }
}
