//! `[spill]` and `[events]` configuration, every default documented.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::size_serde::{de_size, ser_size};

/// Which DRAM blocks are written to NVMe when they are evicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Admission {
    /// Every evicted block (default).
    #[default]
    Always,
    /// Only blocks read at least twice while in DRAM; others are dropped.
    SecondRead,
}

/// The IO engine of the spill files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpillEngine {
    /// io_uring with O_DIRECT and the arena as fixed buffers (default; needs ext4/xfs).
    #[default]
    Uring,
    /// pread/pwrite through the page cache (tmpfs and other file systems without O_DIRECT).
    Psync,
}

/// One spill directory and its byte budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpillDirSetting {
    /// Directory of the spill file (created if missing).
    pub path: PathBuf,
    /// Bytes the spill file may use (e.g. `"64GiB"`).
    #[serde(serialize_with = "ser_size", deserialize_with = "de_size")]
    pub size: u64,
}

/// Fault injection for end-to-end tests (test builds only, feature `test-seams`).
#[cfg(feature = "test-seams")]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DebugFault {
    /// Fail the Nth write request of each spill file with EIO (poisons the tier).
    pub fail_write: Option<u64>,
    /// Fail the Nth fsync of each spill file with EIO (poisons the tier).
    pub fail_fsync: Option<u64>,
    /// Fail the Nth read of each spill file with EIO.
    pub fail_read: Option<u64>,
}

/// The NVMe spill tier (`[spill]`); off while `dirs` is empty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpillSettings {
    /// Spill directories, one per device (`--spill-dir DIR --spill-size SIZE`, repeatable).
    pub dirs: Vec<SpillDirSetting>,
    /// Admission policy. Default `always`.
    pub admission: Admission,
    /// IO engine. Default `uring`.
    pub engine: SpillEngine,
    /// Region size (unit of append and FIFO eviction on NVMe). Default: 64 MiB, lowered to
    /// a quarter of the smallest dir (at least slab size + 12 KiB) for small dirs.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::size_serde::ser_opt_size",
        deserialize_with = "crate::size_serde::de_opt_size"
    )]
    pub region_size: Option<u64>,
    /// Demotion starts when free DRAM falls below this fraction of the tier. Default 0.05.
    pub low_watermark: f64,
    /// Demotion frees DRAM up to this fraction. Default 0.10.
    pub high_watermark: f64,
    /// Most demotions in flight at once. Default 64.
    pub max_in_flight: usize,
    /// A put that finds DRAM full waits up to this long for demotions to free room before
    /// evicting without a copy. Default 500 ms.
    pub room_wait_ms: u64,
    /// Warn when the oldest queued spill operation is older than this. Default 2 s.
    pub stall_warn_s: f64,
    /// Fault injection for tests.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg(feature = "test-seams")]
    pub debug_fault: Option<DebugFault>,
}

impl Default for SpillSettings {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            admission: Admission::Always,
            engine: SpillEngine::Uring,
            region_size: None,
            low_watermark: 0.05,
            high_watermark: 0.10,
            max_in_flight: 64,
            room_wait_ms: 500,
            stall_warn_s: 2.0,
            #[cfg(feature = "test-seams")]
            debug_fault: None,
        }
    }
}

impl SpillSettings {
    /// Checks values that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..1.0).contains(&self.low_watermark)
            || !(self.low_watermark..=1.0).contains(&self.high_watermark)
        {
            return Err("spill watermarks need 0 <= low_watermark <= high_watermark <= 1".into());
        }
        if self.max_in_flight == 0 {
            return Err("spill max_in_flight must be at least 1".into());
        }
        Ok(())
    }
}

/// KV events to the router (`[events]`); off while `endpoint` is unset.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsSettings {
    /// `tcp://HOST:PORT` the ZMQ PUB socket binds (`--events`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// `tcp://HOST:PORT` of the replay ROUTER socket (`--events-replay`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// Data-parallel rank written into every batch (`--dp-rank`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}
