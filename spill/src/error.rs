//! Error types: decode errors for on-disk records and the tier's operational errors.

use std::path::PathBuf;

/// Why an on-disk record (superblock, block header, summary) was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the record needs.
    #[error("record truncated: need {need} bytes, got {got}")]
    Truncated {
        /// Bytes the record needs.
        need: usize,
        /// Bytes available.
        got: usize,
    },
    /// The magic bytes do not match: this is not the expected record.
    #[error("bad {what} magic: not written by kvnode-spill")]
    Magic {
        /// Which record was expected.
        what: &'static str,
    },
    /// Written by a different format version.
    #[error(
        "format version {found} is not supported (this build reads {supported}); use a matching kvnode or empty the spill directory"
    )]
    Version {
        /// Version found on disk.
        found: u16,
        /// Version this build supports.
        supported: u16,
    },
    /// The stored checksum does not match the bytes (torn write or corruption).
    #[error(
        "checksum mismatch (stored {stored:#018x}, computed {computed:#018x}): torn write or corruption"
    )]
    Checksum {
        /// Checksum stored in the record.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// Reserved bytes are not zero.
    #[error("reserved bytes are not zero")]
    Reserved,
    /// Fields decode but describe an impossible geometry or position.
    #[error("record fields are inconsistent (geometry or position)")]
    Geometry,
}

/// Errors of the spill tier: opening, configuration and operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpillError {
    /// The configuration is invalid; the message says which knob to change.
    #[error("invalid spill configuration: {0}")]
    Config(String),
    /// An OS call failed on a spill file.
    #[error("{op} on {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file system under a spill directory refuses `O_DIRECT` or 4096-byte aligned I/O.
    #[error(
        "{path}: file system refuses O_DIRECT 4096-byte I/O ({source}); put the spill dir on a block-device file system (ext4, xfs) or choose the psync IO engine for it"
    )]
    DirectIoUnsupported {
        /// The file concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An existing file at the spill path is not a kvnode spill file.
    #[error(
        "{path} exists and is not a kvnode spill file ({source}); kvnode never overwrites a file it did not write: if nothing else uses it, delete it (kvnode creates a fresh one), else point --spill-dir elsewhere"
    )]
    NotASpillFile {
        /// The file concerned.
        path: PathBuf,
        /// Why its superblock was rejected.
        #[source]
        source: DecodeError,
    },
    /// A spill directory or file that other users could write, replace or that is not ours:
    /// blocks written there could be read or swapped by someone else (see `perms.rs`).
    #[error(
        "{path}: {why}; spill files hold every demoted block of every tenant, so kvnode refuses it: fix the owner or mode (spill dirs are created 0700, files 0600) or point --spill-dir elsewhere"
    )]
    Insecure {
        /// The directory or file concerned.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// Another open holds the spill file's lock: a second daemon on the same directory, or
    /// the same file reached twice in one configuration.
    #[error("{path} is locked by {}", locked_by(*.holder))]
    Locked {
        /// The file concerned.
        path: PathBuf,
        /// The process holding the lock, when /proc/locks tells.
        holder: Option<u32>,
    },
    /// Preallocating a new spill file failed (usually: the device is too small); the
    /// partial file was removed.
    #[error(
        "cannot preallocate {size} bytes for {path} ({source}); the partial file was removed: free space on that device or lower --spill-size"
    )]
    Preallocate {
        /// The file concerned.
        path: PathBuf,
        /// Bytes asked for.
        size: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The existing spill file was created with a different geometry.
    #[error(
        "{path} was created with {found}, the configuration asks for {configured}; its blocks are kept until you decide: restore the old --spill-size (and region size) to keep them, or delete the file to start empty at the new size"
    )]
    GeometryMismatch {
        /// The file concerned.
        path: PathBuf,
        /// Geometry on disk.
        found: String,
        /// Geometry configured.
        configured: String,
    },
    /// A previous write or fsync failed; the tier refuses writes until restarted.
    #[error(
        "spill tier is poisoned ({reason}); it keeps serving verified reads but refuses writes until the device is checked and kvnode restarted"
    )]
    Poisoned {
        /// The failure that poisoned the tier.
        reason: String,
    },
    /// The block is larger than the configured maximum.
    #[error(
        "block of {len} bytes exceeds max_block_size {max}; raise max_block_size or split the block into segments"
    )]
    TooLarge {
        /// Payload length.
        len: usize,
        /// Configured maximum.
        max: usize,
    },
    /// The destination buffer cannot hold the block.
    #[error("destination of {capacity} bytes cannot hold a block of {needed} bytes")]
    BufferTooSmall {
        /// Bytes the block needs.
        needed: usize,
        /// Bytes the destination offers.
        capacity: usize,
    },
    /// An arena slice lies outside the registered arena, or no arena is registered.
    #[error("arena slice {offset}+{len} is outside the registered arena ({arena_len} bytes)")]
    ArenaRange {
        /// Slice offset.
        offset: usize,
        /// Slice length.
        len: usize,
        /// Registered arena length (0 when none is registered).
        arena_len: usize,
    },
    /// The bounded submission queue is full (backpressure); retry later.
    #[error("spill submission queue is full ({depth} queued); retry later or raise queue_depth")]
    QueueFull {
        /// Operations queued on the chosen file.
        depth: usize,
    },
    /// Every region is busy (being written or sealed); retry later.
    #[error("no spill region can be reclaimed right now; retry later")]
    NoSpace,
    /// The IO worker stopped (tier shut down).
    #[error("spill IO worker stopped; the tier is shutting down")]
    Stopped,
    /// The arena was already registered.
    #[error("an arena is already registered with this tier")]
    ArenaAlreadyRegistered,
}

fn locked_by(holder: Option<u32>) -> String {
    match holder {
        Some(pid) if pid == std::process::id() => format!(
            "this process (pid {pid}): the same spill file is configured twice (two --spill-dir paths name one directory); give each directory once"
        ),
        Some(pid) => format!(
            "another process (pid {pid}): two daemons must not share a spill directory; stop that one or give this daemon its own --spill-dir"
        ),
        None => "another open (another kvnode daemon?): two daemons must not share a spill directory; stop the other one or give this daemon its own --spill-dir".to_owned(),
    }
}

impl SpillError {
    pub(crate) fn io(op: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}
