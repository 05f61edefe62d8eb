//! kvnode's disk spill tier: checksummed blocks in preallocated files, written and read
//! through `io_uring` with `O_DIRECT`, rebuilt from the files at start-up.
//!
//! The crate knows nothing of the engine: it stores opaque blocks under a [`SpillKey`] and
//! moves bytes between the files and memory the engine owns (its registered DRAM arena, or
//! any other buffer).
//!
//! ```text
//!  engine (tokio or plain threads)
//!    | write(key, IoBuf) / read(key, IoBuf) -> Completion<Done<_>>  (await or wait)
//!    v
//!  SpillTier ---- index: key -> (file, region, offset, len, seq, checksum) ----+
//!    | bounded queue per file (try_* refuses when full)                       |
//!    v                                                                        |
//!  IO worker thread per file: region allocator, checksum, bounce if unaligned  |
//!    | IoEngine: Uring (`O_DIRECT`, READ/WRITE_FIXED from the arena)             |
//!    |           Psync (pread/pwrite)  |  Faulty (wraps either; tests)         |
//!    v                                                                        |
//!  dir/kvnode-spill.dat: [superblock][region 0][region 1]...                   |
//!     region: [hdr|payload][hdr|payload]... free ...[summary entries][trailer] |
//!  start-up: summaries (or a sector scan of unsealed regions) ------------------+
//! ```
//!
//! Blocks are appended into the open region of a file; a full region is fdatasynced and
//! sealed with a summary of its headers; when no region is free the oldest sealed region is
//! reclaimed and its blocks are reported as evicted in the triggering write's
//! [`WriteOutcome::evicted`]. Every read is verified against the xxh3-64 payload checksum
//! before it is reported as a hit; a mismatch is a counted miss. After a failed write or
//! fsync the tier is poisoned: writes are refused, verified reads continue.
//!
//! Durability: a completed write survives a process crash (the bytes are in the file, or in
//! the page cache for `Psync`); it survives power loss once a later fdatasync completed —
//! [`SpillTier::sync`], the periodic `sync_interval`, a region seal, or a clean shutdown.
//! The byte layout is specified in `docs/spill-format.md`.

mod buf;
mod completion;
mod config;
mod engine;
mod error;
mod file;
pub mod fio;
mod format;
mod handoff;
mod key;
mod lock;
mod ops;
mod perms;
mod recovery;
mod region;
mod stats;
mod tier;
mod worker;

pub use buf::{ARENA_PIECE, AlignedBuf, ArenaSlice, Done, IoBuf, RawBuf};
pub use completion::Completion;
pub use config::{SPILL_FILE_NAME, SpillConfig, SpillConfigBuilder, SpillDir};
#[cfg(feature = "fault-injection")]
pub use engine::FaultPlan;
pub use engine::IoEngineKind;
pub use error::{DecodeError, SpillError};
pub use key::SpillKey;
pub use ops::{MissReason, ReadOutcome, WriteOutcome};
pub use stats::SpillStats;
pub use tier::{FileRecovery, RecoveryReport, SpillOpening, SpillTier};

/// On-disk record codecs, public for fuzzing, property tests and offline inspection tools.
pub mod disk {
    pub use crate::format::{
        BlockHeader, FORMAT_VERSION, HEADER_LEN, RecordKind, SECTOR, SUPERBLOCK_LEN,
        SummaryTrailer, Superblock, TRAILER_LEN, encode_summary, payload_checksum, round_up,
    };
}
