//! Tier configuration and its builder; every default is documented on the builder method.

use crate::engine::IoEngineKind;
use crate::error::SpillError;
use crate::format::{SECTOR, round_up};
use std::path::PathBuf;
use std::time::Duration;

/// Name of the spill file created inside each spill directory.
pub const SPILL_FILE_NAME: &str = "kvnode-spill.dat";

/// One spill directory (normally one per device) and the bytes it may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillDir {
    /// Directory holding the spill file (created if missing).
    pub path: PathBuf,
    /// Bytes the spill file may occupy; rounded down to whole regions plus the superblock.
    pub size: u64,
}

/// A validated spill tier configuration. Build it with [`SpillConfig::builder`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillConfig {
    pub(crate) dirs: Vec<SpillDir>,
    pub(crate) engine: IoEngineKind,
    pub(crate) region_size: u64,
    pub(crate) max_block_size: usize,
    pub(crate) queue_depth: usize,
    pub(crate) submit_queue: usize,
    pub(crate) sync_interval: Option<Duration>,
    pub(crate) seal_on_shutdown: bool,
}

impl SpillConfig {
    /// Starts a builder with the documented defaults and no directories.
    pub fn builder() -> SpillConfigBuilder {
        SpillConfigBuilder {
            cfg: SpillConfig {
                dirs: Vec::new(),
                engine: IoEngineKind::Uring,
                region_size: 64 << 20,
                max_block_size: 16 << 20,
                queue_depth: 32,
                submit_queue: 1024,
                sync_interval: Some(Duration::from_secs(1)),
                seal_on_shutdown: true,
            },
        }
    }

    /// Size of the spill file in `dir` under this configuration.
    pub(crate) fn file_size(&self, dir: &SpillDir) -> u64 {
        SECTOR + self.regions_in(dir) * self.region_size
    }

    pub(crate) fn regions_in(&self, dir: &SpillDir) -> u64 {
        dir.size.saturating_sub(SECTOR) / self.region_size
    }

    /// Payload capacity of all files (regions times region size).
    pub fn capacity(&self) -> u64 {
        self.dirs
            .iter()
            .map(|d| self.regions_in(d) * self.region_size)
            .sum()
    }

    /// The configured directories.
    pub fn dirs(&self) -> &[SpillDir] {
        &self.dirs
    }

    /// Largest payload accepted by a write.
    pub fn max_block_size(&self) -> usize {
        self.max_block_size
    }
}

/// The first two entries naming one directory (after resolving `.`/`..`, symlinks of
/// existing paths and the working directory). Paths that resolve
/// differently here but still meet in one file are caught by the file lock at open.
fn duplicate_dir(dirs: &[SpillDir]) -> Option<(usize, usize)> {
    let resolved: Vec<PathBuf> = dirs
        .iter()
        .map(|d| {
            std::fs::canonicalize(&d.path)
                .or_else(|_| std::path::absolute(&d.path))
                .unwrap_or_else(|_| d.path.clone())
        })
        .collect();
    for (j, b) in resolved.iter().enumerate() {
        if let Some(i) = resolved[..j].iter().position(|a| a == b) {
            return Some((i, j));
        }
    }
    None
}

/// Builder for [`SpillConfig`].
#[derive(Clone, Debug)]
pub struct SpillConfigBuilder {
    cfg: SpillConfig,
}

impl SpillConfigBuilder {
    /// Adds a spill directory with its byte budget. At least one is required; each becomes
    /// one file served by its own IO worker thread and ring.
    #[must_use]
    pub fn dir(mut self, path: impl Into<PathBuf>, size: u64) -> Self {
        self.cfg.dirs.push(SpillDir {
            path: path.into(),
            size,
        });
        self
    }

    /// IO engine. Default [`IoEngineKind::Uring`] (`O_DIRECT`; fails at open on file systems
    /// that refuse it, with an error naming the directory).
    #[must_use]
    pub fn engine(mut self, engine: IoEngineKind) -> Self {
        self.cfg.engine = engine;
        self
    }

    /// Region size: the unit of append, sealing and FIFO eviction. Default 64 MiB. Must be a
    /// multiple of 4096 and hold a max-size block plus three sectors; each file needs at
    /// least two regions.
    #[must_use]
    pub fn region_size(mut self, bytes: u64) -> Self {
        self.cfg.region_size = bytes;
        self
    }

    /// Largest block payload. Default 16 MiB.
    #[must_use]
    pub fn max_block_size(mut self, bytes: usize) -> Self {
        self.cfg.max_block_size = bytes;
        self
    }

    /// Operations in flight per file (ring depth is twice this). Default 32.
    #[must_use]
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.cfg.queue_depth = n;
        self
    }

    /// Bounded submission queue per file; `try_*` calls fail with `QueueFull` beyond it and
    /// blocking calls wait. Default 1024.
    #[must_use]
    pub fn submit_queue(mut self, n: usize) -> Self {
        self.cfg.submit_queue = n;
        self
    }

    /// fdatasync period while writes are arriving; `None` syncs only on [`crate::SpillTier::sync`],
    /// region seal and shutdown. Default 1 s.
    #[must_use]
    pub fn sync_interval(mut self, every: Option<Duration>) -> Self {
        self.cfg.sync_interval = every;
        self
    }

    /// On drop, wait for in-flight writes, seal the open region (writes its summary) and
    /// fdatasync. `false` stops like a crash (useful for recovery tests). Default `true`.
    #[must_use]
    pub fn seal_on_shutdown(mut self, yes: bool) -> Self {
        self.cfg.seal_on_shutdown = yes;
        self
    }

    /// Validates and returns the configuration.
    pub fn build(self) -> Result<SpillConfig, SpillError> {
        let c = self.cfg;
        let bad = |m: String| Err(SpillError::Config(m));
        if c.dirs.is_empty() {
            return bad("no spill directory given (add one with --spill-dir)".into());
        }
        if c.dirs.len() > usize::from(u16::MAX) {
            return bad("too many spill directories".into());
        }
        if !c.region_size.is_multiple_of(SECTOR) || c.region_size > u64::from(u32::MAX) {
            return bad(format!(
                "region_size {} must be a multiple of 4096 below 4 GiB",
                c.region_size
            ));
        }
        if c.max_block_size == 0 || c.max_block_size > (1 << 30) {
            return bad(format!(
                "max_block_size {} must be between 1 and 1 GiB",
                c.max_block_size
            ));
        }
        let need = round_up(c.max_block_size as u64) + 3 * SECTOR;
        if c.region_size < need {
            return bad(format!(
                "region_size {} cannot hold a block of max_block_size {} (needs >= {need})",
                c.region_size, c.max_block_size
            ));
        }
        if c.queue_depth == 0 || c.queue_depth > 4096 || c.submit_queue == 0 {
            return bad("queue_depth must be 1..=4096 and submit_queue >= 1".into());
        }
        if let Some((i, j)) = duplicate_dir(&c.dirs) {
            return bad(format!(
                "spill directory {} is given twice (entries {i} and {j}{}); each directory holds one spill file, so give each device once",
                c.dirs[i].path.display(),
                if c.dirs[j].path == c.dirs[i].path {
                    String::new()
                } else {
                    format!(": {} is the same directory", c.dirs[j].path.display())
                },
            ));
        }
        for d in &c.dirs {
            if c.regions_in(d) < 2 {
                return bad(format!(
                    "spill size {} for {} holds fewer than two regions of {} bytes; raise --spill-size or lower region_size",
                    d.size,
                    d.path.display(),
                    c.region_size
                ));
            }
        }
        Ok(c)
    }
}
