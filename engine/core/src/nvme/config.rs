//! `[spill]` and `[events]` configuration, every default documented.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use std::time::Duration;

use crate::size_serde::{de_size, ser_size};

/// Parses a duration: a number with a unit `ms`, `s`, `m` or `h` (`"250ms"`, `"1.5s"`), or a
/// plain number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?}: expected e.g. 500ms, 2s, 1m"))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => {
            return Err(format!(
                "bad duration {s:?}: unknown unit {u:?} (ms, s, m, h)"
            ));
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("bad duration {s:?}: {e}"))
}

/// Renders a duration the way [`parse_duration`] reads it.
pub fn show_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_secs_f64() * 1e3)
    }
}

fn de_opt_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Num(f64),
        Str(String),
    }
    match Repr::deserialize(d)? {
        Repr::Num(n) => Duration::try_from_secs_f64(n)
            .map(Some)
            .map_err(serde::de::Error::custom),
        Repr::Str(s) => parse_duration(&s)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

#[expect(clippy::ref_option, reason = "serde serialize_with passes references")]
fn ser_opt_duration<S: serde::Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(d) => s.serialize_str(&show_duration(*d)),
        None => s.serialize_none(),
    }
}

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
    /// Write-behind (`--spill-lag`, e.g. `"2s"`, `"500ms"`): every block committed to DRAM
    /// is also written to NVMe, picked once half this lag old, so a crash (SIGKILL, power loss
    /// after the periodic fsync) loses only blocks not yet copied. A target, not a bound:
    /// puts are not slowed when the disk falls behind (counted as `lag_exceeded`). Default: off.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_opt_duration",
        deserialize_with = "de_opt_duration"
    )]
    pub lag: Option<std::time::Duration>,
    /// On SIGTERM/SIGINT, after the last request, write DRAM blocks that have no copy on
    /// NVMe for at most this many seconds, so a plain stop and start keeps them (a takeover
    /// hands the arena over instead and skips it). 0 turns it off. Default: 60.
    pub flush_on_stop_s: f64,
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
            lag: None,
            flush_on_stop_s: 60.0,
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
        if self.lag.is_some() && self.dirs.is_empty() {
            return Err("spill lag (--spill-lag) needs a spill directory (--spill-dir)".into());
        }
        if let Some(l) = self.lag
            && !(Duration::from_millis(1)..=Duration::from_hours(1)).contains(&l)
        {
            return Err(format!(
                "spill lag {} must be between 1ms and 1h",
                show_duration(l)
            ));
        }
        if !(0.0..=86400.0).contains(&self.flush_on_stop_s) {
            return Err("spill flush_on_stop_s must be between 0 and 86400".into());
        }
        Ok(())
    }
}

pub use crate::residency::settings::EventsSettings;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_garbage() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_mins(1)));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn lag_roundtrips_through_toml_and_is_bounded() {
        let s: SpillSettings = toml::from_str("lag = \"500ms\"").unwrap();
        assert_eq!(s.lag, Some(Duration::from_millis(500)));
        let back: SpillSettings = toml::from_str(&toml::to_string(&s).unwrap()).unwrap();
        assert_eq!(back.lag, s.lag);
        let dirs = vec![SpillDirSetting {
            path: "/tmp/x".into(),
            size: 1 << 30,
        }];
        let bad = SpillSettings {
            lag: Some(Duration::from_hours(2)),
            dirs: dirs.clone(),
            ..SpillSettings::default()
        };
        assert!(bad.validate().unwrap_err().contains("between 1ms and 1h"));
        let no_dir = SpillSettings {
            lag: Some(Duration::from_secs(1)),
            ..SpillSettings::default()
        };
        assert!(
            no_dir
                .validate()
                .unwrap_err()
                .contains("needs a spill directory")
        );
        let fine = SpillSettings {
            lag: Some(Duration::from_secs(1)),
            dirs,
            ..SpillSettings::default()
        };
        assert_eq!(fine.validate(), Ok(()));
    }
}
