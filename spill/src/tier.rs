//! `SpillTier`: opens and recovers the files, starts one IO worker per file, routes operations.

use crate::buf::{Arena, Done, IoBuf};
use crate::completion::{self, Completion};
use crate::config::{SPILL_FILE_NAME, SpillConfig};
use crate::engine::IoEngine;
use crate::error::SpillError;
use crate::file::open_spill_file;
use crate::format::RecordKind;
use crate::key::SpillKey;
use crate::ops::{BufOp, Mark, MarkQueue, MissReason, Msg, ReadOutcome, UnitOp, WriteOutcome};
use crate::recovery::{FileScan, MarkSet, scan_file};
use crate::region::Regions;
use crate::stats::{Loc, Shared, SpillStats, Tracker};
use crate::worker::{Worker, WorkerSettings};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What recovery found in one spill file.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileRecovery {
    /// The spill file.
    pub path: PathBuf,
    /// The file was created (or reinitialised after a damaged superblock) at this start.
    pub fresh: bool,
    /// Identity from the superblock.
    pub uuid: [u8; 16],
    /// Valid blocks found (before resolving deletes, clears and duplicates across files).
    pub blocks: u64,
    /// Delete and clear markers found.
    pub markers: u64,
    /// Torn or corrupt blocks skipped.
    pub skipped: u64,
    /// Regions read from their summary.
    pub summaries: u64,
    /// Regions scanned sector by sector (unsealed at the last stop).
    pub scanned: u64,
}

/// What [`SpillTier::open`] rebuilt from the files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// Per-file details.
    pub files: Vec<FileRecovery>,
    /// Blocks indexed after resolving duplicates (newest sequence wins).
    pub blocks: u64,
    /// Payload bytes of those blocks.
    pub bytes: u64,
    /// Torn or corrupt blocks skipped, all files.
    pub skipped: u64,
    /// Older copies of keys that a newer copy replaced.
    pub superseded: u64,
    /// Blocks found on disk that a later delete or clear marker ended (not indexed).
    pub deleted: u64,
    /// Wall time of recovery.
    pub elapsed: Duration,
}

struct WorkerHandle {
    tx: Option<SyncSender<Msg>>,
    marks: Arc<MarkQueue>,
    wake: Option<OwnedFd>,
    tracker: Arc<Tracker>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    fn wake(&self) {
        if let Some(fd) = &self.wake {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a local to an eventfd this handle owns.
            unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    }

    /// Sends `msg`; with `block == false` a full queue hands the message back.
    fn send(&self, msg: Msg, block: bool) -> Result<(), Box<Msg>> {
        let Some(tx) = &self.tx else {
            return Err(Box::new(msg));
        };
        let r = if block {
            tx.send(msg).map_err(|e| Box::new(e.0))
        } else {
            tx.try_send(msg).map_err(|e| match e {
                TrySendError::Full(m) | TrySendError::Disconnected(m) => Box::new(m),
            })
        };
        if r.is_ok() {
            self.wake();
        }
        r
    }
}

/// The disk spill tier: a set of preallocated files, one IO worker thread (and ring) each.
pub struct SpillTier {
    workers: Vec<WorkerHandle>,
    shared: Arc<Shared>,
    config: SpillConfig,
    arena: Mutex<Option<Arena>>,
    next: AtomicUsize,
    recovery: RecoveryReport,
}

impl std::fmt::Debug for SpillTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillTier")
            .field("files", &self.workers.len())
            .finish_non_exhaustive()
    }
}

fn eventfd() -> Result<OwnedFd, SpillError> {
    // SAFETY: plain syscall; the returned fd is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(SpillError::io(
            "eventfd",
            "/".as_ref(),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl SpillTier {
    /// Opens every configured file (creating and preallocating missing ones), rebuilds the
    /// index from what is on disk, and starts the IO workers.
    pub fn open(config: SpillConfig) -> Result<Self, SpillError> {
        SpillOpening::lock(config)?.recover()
    }
}

/// Spill files opened and locked, their index not rebuilt yet ([`SpillOpening::lock`]):
/// what can refuse a start (a missing directory, a file another daemon holds, a damaged
/// superblock that cannot be rewritten) has been checked, and the rebuild, which takes time
/// in proportion to the blocks on disk, can run elsewhere ([`SpillOpening::recover`]).
pub struct SpillOpening {
    config: SpillConfig,
    files: Vec<crate::file::SpillFile>,
    t0: Instant,
}

impl std::fmt::Debug for SpillOpening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillOpening")
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

impl SpillOpening {
    /// Opens (creating and preallocating missing ones) and locks every configured file.
    pub fn lock(config: SpillConfig) -> Result<Self, SpillError> {
        let t0 = Instant::now();
        let direct = config.engine.direct();
        let files = config
            .dirs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                open_spill_file(
                    &d.path.join(SPILL_FILE_NAME),
                    i as u32,
                    config.file_size(d),
                    config.region_size,
                    direct,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { config, files, t0 })
    }

    /// Rebuilds the index from the files (one thread per file) and starts the IO workers.
    pub fn recover(self) -> Result<SpillTier, SpillError> {
        let Self { config, files, t0 } = self;
        let opened: Vec<Result<_, SpillError>> = std::thread::scope(|s| {
            let hs: Vec<_> = files
                .into_iter()
                .zip(&config.dirs)
                .map(|(f, d)| {
                    let cfg = &config;
                    s.spawn(move || {
                        let scan = scan_file(&f, cfg.regions_in(d), cfg.region_size)?;
                        Ok((f, scan))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(Err(SpillError::Stopped)))
                .collect()
        });
        let shared = Arc::new(Shared::default());
        let mut report = RecoveryReport::default();
        let mut files = Vec::new();
        let mut max_seq = 0;
        let mut total = 0u64;
        {
            let mut idx = shared.index();
            idx.reserve(
                opened
                    .iter()
                    .flatten()
                    .flat_map(|(_, scan)| &scan.regions)
                    .map(|r| r.entries.len())
                    .sum(),
            );
            for (i, r) in opened.into_iter().enumerate() {
                let (f, scan) = r?;
                let found = index_file(&mut idx, i as u16, &scan);
                max_seq = max_seq.max(found.max_seq);
                total += found.offered;
                report.deleted += found.deleted;
                let (blocks, markers) = (found.blocks, found.markers);
                report.skipped += scan.skipped;
                report.files.push(FileRecovery {
                    path: f.path.clone(),
                    fresh: f.fresh,
                    uuid: f.sb.uuid,
                    blocks,
                    markers,
                    skipped: scan.skipped,
                    summaries: scan.summaries,
                    scanned: scan.scanned,
                });
                files.push((f, scan));
            }
            report.blocks = idx.len() as u64;
            report.bytes = idx.bytes();
            report.superseded = total - report.blocks;
        }
        shared.seq.store(max_seq + 1, Relaxed);
        report.elapsed = t0.elapsed();
        if report.skipped > 0 {
            tracing::warn!(
                skipped = report.skipped,
                "spill recovery skipped torn or corrupt blocks"
            );
        }
        let workers = files
            .into_iter()
            .enumerate()
            .map(|(i, (f, scan))| SpillTier::start_worker(&config, &shared, i as u16, f, scan))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SpillTier {
            workers,
            shared,
            config,
            arena: Mutex::new(None),
            next: AtomicUsize::new(0),
            recovery: report,
        })
    }
}

/// What [`index_file`] found in one file.
struct FileIndexed {
    blocks: u64,
    markers: u64,
    /// Blocks a marker ended.
    deleted: u64,
    /// Blocks offered to the index (some may lose to a newer copy in another file).
    offered: u64,
    max_seq: u64,
}

/// Indexes the blocks of file `file` that no marker of the same file ended.
fn index_file(idx: &mut crate::stats::Index, file: u16, scan: &FileScan) -> FileIndexed {
    let marks = MarkSet::of(scan.records());
    let mut n = FileIndexed {
        blocks: 0,
        markers: 0,
        deleted: 0,
        offered: 0,
        max_seq: 0,
    };
    for (ri, reg) in scan.regions.iter().enumerate() {
        n.max_seq = n.max_seq.max(reg.generation);
        for h in &reg.entries {
            n.max_seq = n.max_seq.max(h.seq);
            if h.kind.is_marker() {
                n.markers += 1;
                continue;
            }
            n.blocks += 1;
            if marks.ended(h) {
                n.deleted += 1;
                continue;
            }
            n.offered += 1;
            let loc = Loc {
                file,
                region: ri as u32,
                generation: h.region_gen,
                offset: h.file_offset,
                len: h.payload_len,
                seq: h.seq,
                checksum: h.payload_checksum,
            };
            idx.insert_if_newer(h.key, loc);
        }
    }
    n
}

impl SpillTier {
    fn start_worker(
        config: &SpillConfig,
        shared: &Arc<Shared>,
        index: u16,
        f: crate::file::SpillFile,
        scan: FileScan,
    ) -> Result<WorkerHandle, SpillError> {
        let wake = if config.engine.uses_ring() {
            Some(eventfd()?)
        } else {
            None
        };
        let wake_raw = wake.as_ref().map(AsRawFd::as_raw_fd);
        let (tx, rx) = sync_channel::<Msg>(config.submit_queue);
        let (ready_tx, ready_rx) = sync_channel::<Result<(), SpillError>>(1);
        let set = WorkerSettings {
            index,
            queue_depth: config.queue_depth,
            max_block: config.max_block_size,
            sync_interval: config.sync_interval,
            seal_on_shutdown: config.seal_on_shutdown,
        };
        let kind = config.engine.clone();
        let shared = shared.clone();
        let regions = Regions::from_scan(config.region_size, scan.regions);
        let marks = Arc::new(MarkQueue::default());
        let worker_marks = marks.clone();
        let entries = (config.queue_depth * 2 + 8) as u32;
        let thread = std::thread::Builder::new()
            .name(format!("kvnode-spill-{index}"))
            .spawn(move || {
                let engine = match IoEngine::new(&kind, f.file.as_raw_fd(), entries, wake_raw) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(SpillError::io(
                            "creating io engine (io_uring_setup)",
                            &f.path,
                            e,
                        )));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                Worker::new(set, f, engine, kind.direct(), regions, shared, worker_marks).run(&rx);
            })
            .map_err(|e| SpillError::io("spawning IO worker", "/".as_ref(), e))?;
        ready_rx.recv().unwrap_or(Err(SpillError::Stopped))?;
        Ok(WorkerHandle {
            tx: Some(tx),
            marks,
            wake,
            tracker: Arc::new(Tracker::default()),
            thread: Some(thread),
        })
    }

    /// What recovery found when this tier was opened.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The configuration the tier was opened with.
    pub fn config(&self) -> &SpillConfig {
        &self.config
    }

    /// Registers the engine's DRAM arena with every ring as fixed buffers (≤ 1 GiB pieces), so
    /// [`IoBuf::Arena`] transfers use `READ_FIXED/WRITE_FIXED`. Call once; blocks until every
    /// worker registered. Registration pins the memory (needs `RLIMIT_MEMLOCK` or
    /// `CAP_IPC_LOCK`).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the tier is dropped. While an operation on an
    /// arena slice is in flight, nobody may write that slice (write op) or access it (read op).
    pub unsafe fn register_arena(&self, ptr: *mut u8, len: usize) -> Result<(), SpillError> {
        self.set_arena(Arena {
            base: ptr as usize,
            len,
            registered: true,
        })
    }

    /// Hands the workers `arena`, once per tier.
    fn set_arena(&self, arena: Arena) -> Result<(), SpillError> {
        let mut slot = self
            .arena
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_some() {
            return Err(SpillError::ArenaAlreadyRegistered);
        }
        self.send_arena(arena)?;
        *slot = Some(arena);
        Ok(())
    }

    fn send_arena(&self, arena: Arena) -> Result<(), SpillError> {
        let waits: Vec<_> = self
            .workers
            .iter()
            .map(|w| {
                let (c, r) = completion::pair();
                let op = UnitOp::new(c, w.tracker.clone());
                let _ = w.send(Msg::Arena { arena, op }, true);
                r
            })
            .collect();
        for r in waits {
            r.wait()?;
        }
        Ok(())
    }

    /// Lets [`IoBuf::Arena`] transfers use the engine's arena at once, as plain (not fixed
    /// buffer) reads and writes: instant, pins nothing. [`SpillTier::register_attached_arena`]
    /// later switches them to fixed buffers. Call once, instead of `register_arena`.
    ///
    /// # Safety
    /// As for [`SpillTier::register_arena`].
    pub unsafe fn attach_arena(&self, ptr: *mut u8, len: usize) -> Result<(), SpillError> {
        self.set_arena(Arena {
            base: ptr as usize,
            len,
            registered: false,
        })
    }

    /// Registers the arena given to [`SpillTier::attach_arena`] as fixed buffers (pins it;
    /// best done once it is faulted in, since each worker pauses its IO while the kernel
    /// pins the pages). Returns `Ok(false)` when no arena is attached or it is registered.
    pub fn register_attached_arena(&self) -> Result<bool, SpillError> {
        let mut slot = self
            .arena
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(a) = *slot else { return Ok(false) };
        if a.registered {
            return Ok(false);
        }
        let arena = Arena {
            registered: true,
            ..a
        };
        self.send_arena(arena)?;
        *slot = Some(arena);
        Ok(true)
    }

    fn submit_write(
        &self,
        key: SpillKey,
        buf: IoBuf,
        block: bool,
    ) -> Completion<Done<WriteOutcome>> {
        if let Some(reason) = self.shared.poisoned() {
            return completion::ready(Done {
                buf,
                result: Err(SpillError::Poisoned { reason }),
            });
        }
        if buf.len() > self.config.max_block_size {
            let e = SpillError::TooLarge {
                len: buf.len(),
                max: self.config.max_block_size,
            };
            return completion::ready(Done {
                buf,
                result: Err(e),
            });
        }
        let w = &self.workers[self.file_for(&key)];
        let (c, r) = completion::pair();
        let op = BufOp::new(buf, c, w.tracker.clone());
        if let Err(msg) = w.send(Msg::Write { key, op }, block) {
            self.refuse(*msg, w);
        }
        r
    }

    /// The file a write of `key` goes to: the one holding its indexed copy, if any, else the
    /// next in turn. Keeping a key's copies in one file means the older copy's region is
    /// reclaimed before the newer one's (FIFO), so an older copy never outlives the newer
    /// one and comes back at a restart after the newer one was evicted.
    fn file_for(&self, key: &SpillKey) -> usize {
        match self.shared.index().get(key) {
            Some(loc) => usize::from(loc.file),
            None => self.next.fetch_add(1, Relaxed) % self.workers.len(),
        }
    }

    fn submit_read(&self, key: SpillKey, buf: IoBuf, block: bool) -> Completion<Done<ReadOutcome>> {
        let Some(loc) = self.shared.index().get(&key) else {
            let c = &self.shared.counters;
            Shared::bump(&c.reads, 1);
            Shared::bump(&c.misses, 1);
            return completion::ready(Done {
                buf,
                result: Ok(ReadOutcome::Miss(MissReason::NotFound)),
            });
        };
        let w = &self.workers[usize::from(loc.file)];
        let (c, r) = completion::pair();
        let op = BufOp::new(buf, c, w.tracker.clone());
        if let Err(msg) = w.send(Msg::Read { key, loc, op }, block) {
            self.refuse(*msg, w);
        }
        r
    }

    /// Completes a message that could not be queued with `QueueFull` (or `Stopped`).
    fn refuse(&self, msg: Msg, w: &WorkerHandle) {
        Shared::bump(&self.shared.counters.queue_full, 1);
        let depth = w.tracker.depth_and_age().0;
        match msg {
            Msg::Write { op, .. } => op.finish(Err(SpillError::QueueFull { depth })),
            Msg::Read { op, .. } => op.finish(Err(SpillError::QueueFull { depth })),
            Msg::Sync(op) | Msg::Arena { op, .. } => {
                op.finish(Err(SpillError::QueueFull { depth }));
            }
            Msg::Wake => {}
        }
    }

    /// Writes `buf` as the block `key`; waits for queue space if the file's queue is full.
    /// The completion hands `buf` back. A later write of the same key supersedes this one.
    pub fn write(&self, key: SpillKey, buf: IoBuf) -> Completion<Done<WriteOutcome>> {
        self.submit_write(key, buf, true)
    }

    /// Like [`SpillTier::write`] but never blocks: a full queue completes at once with
    /// [`SpillError::QueueFull`] and the buffer handed back.
    pub fn try_write(&self, key: SpillKey, buf: IoBuf) -> Completion<Done<WriteOutcome>> {
        self.submit_write(key, buf, false)
    }

    /// Reads block `key` into `buf`, verifying its checksum before reporting a hit.
    pub fn read(&self, key: SpillKey, buf: IoBuf) -> Completion<Done<ReadOutcome>> {
        self.submit_read(key, buf, true)
    }

    /// Like [`SpillTier::read`] but never blocks on a full queue.
    pub fn try_read(&self, key: SpillKey, buf: IoBuf) -> Completion<Done<ReadOutcome>> {
        self.submit_read(key, buf, false)
    }

    /// Whether `key` is indexed (a read may still miss if the bytes turn out damaged).
    pub fn contains(&self, key: &SpillKey) -> bool {
        self.shared.index().get(key).is_some()
    }

    /// Payload length of `key`, if indexed.
    pub fn block_len(&self, key: &SpillKey) -> Option<usize> {
        self.shared.index().get(key).map(|l| l.len as usize)
    }

    /// Deletes `key`: it is a miss from now on, and a delete marker queued for every file
    /// keeps it deleted across a restart once written (a crash before that can recover it;
    /// see docs/spill-format.md, "Deletes and clears"). Its space is reclaimed with its
    /// region. Returns whether it was indexed; a key that was not writes no marker.
    pub fn delete(&self, key: &SpillKey) -> bool {
        let held = self.shared.index().remove(key).is_some();
        if held {
            self.mark(Mark {
                kind: RecordKind::Delete,
                key: *key,
            });
        }
        held
    }

    /// Deletes every block of `namespace` (or every block), persisted like [`Self::delete`]
    /// with one clear marker per file when any key was indexed (a clear that finds nothing
    /// writes nothing, so repeating one cannot fill the log and push other tenants' blocks
    /// out). Returns the keys that were indexed.
    pub fn clear(&self, namespace: Option<u128>) -> Vec<SpillKey> {
        let removed = {
            let mut idx = self.shared.index();
            let keys: Vec<SpillKey> = idx
                .keys()
                .into_iter()
                .filter(|k| namespace.is_none_or(|n| k.namespace == n))
                .collect();
            for k in &keys {
                idx.remove(k);
            }
            keys
        };
        if removed.is_empty() {
            return removed;
        }
        let (kind, namespace) = match namespace {
            Some(n) => (RecordKind::ClearNamespace, n),
            None => (RecordKind::ClearAll, 0),
        };
        self.mark(Mark {
            kind,
            key: SpillKey {
                namespace,
                digest: [0; 32],
                segment: 0,
            },
        });
        removed
    }

    /// Queues `m` for every file's worker and wakes it; never blocks, never refused.
    fn mark(&self, m: Mark) {
        for w in &self.workers {
            w.marks.extend([m]);
            if w.send(Msg::Wake, false).is_err() {
                // A full queue: the worker is busy and takes the marks on its next turn.
                w.wake();
            }
        }
    }

    /// Keys evicted since the last call by the writes of delete and clear markers (a marker
    /// takes room like a block and may reclaim a region). Block writes report what they evict
    /// in their [`WriteOutcome`]; these have no outcome, so the owner polls for them.
    pub fn take_evicted(&self) -> Vec<SpillKey> {
        self.shared.orphans.take()
    }

    /// Every indexed key (e.g. to publish stored events after recovery).
    pub fn keys(&self) -> Vec<SpillKey> {
        self.shared.index().keys()
    }

    /// fdatasyncs every file; completes when all blocks whose writes completed before this
    /// call are durable. A failure poisons the tier.
    pub fn sync(&self) -> Completion<Result<(), SpillError>> {
        let waits: Vec<_> = self
            .workers
            .iter()
            .map(|w| {
                let (c, r) = completion::pair();
                let op = UnitOp::new(c, w.tracker.clone());
                if let Err(msg) = w.send(Msg::Sync(op), true) {
                    self.refuse(*msg, w);
                }
                r
            })
            .collect();
        let (c, r) = completion::pair();
        std::thread::spawn(move || {
            let mut result = Ok(());
            for w in waits {
                if let Err(e) = w.wait() {
                    result = result.and(Err(e));
                }
            }
            c.complete(result);
        });
        r
    }

    /// Why the tier refuses writes, if it does.
    pub fn poisoned(&self) -> Option<String> {
        self.shared.poisoned()
    }

    /// A snapshot of counters and gauges.
    pub fn stats(&self) -> SpillStats {
        let c = &self.shared.counters;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed);
        let (blocks, bytes) = {
            let i = self.shared.index();
            (i.len() as u64, i.bytes())
        };
        let mut depth = 0;
        let mut oldest: Option<Duration> = None;
        for w in &self.workers {
            let (d, a) = w.tracker.depth_and_age();
            depth += d as u64;
            oldest = oldest.max(a);
        }
        SpillStats {
            blocks,
            bytes,
            capacity: self.config.capacity(),
            reads: ld(&c.reads),
            writes: ld(&c.writes),
            read_bytes: ld(&c.read_bytes),
            write_bytes: ld(&c.write_bytes),
            hits: ld(&c.hits),
            misses: ld(&c.misses),
            checksum_failures: ld(&c.checksum_failures),
            recovered_blocks: self.recovery.blocks,
            recovery_skipped: self.recovery.skipped,
            errors: ld(&c.errors),
            evictions: ld(&c.evictions),
            queue_depth: depth,
            oldest_queued: oldest,
            poisoned: self.shared.poisoned(),
            bounce_copies: ld(&c.bounce_copies),
            queue_full: ld(&c.queue_full),
            syncs: ld(&c.syncs),
            marks_written: ld(&c.marks),
            recovery_deleted: self.recovery.deleted,
        }
    }
}

impl Drop for SpillTier {
    /// Stops the workers: queued operations finish, then (if `seal_on_shutdown`) the open
    /// region is sealed and the files fdatasynced.
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.tx = None;
            w.wake();
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        // Each worker's ring holds its file until the kernel has torn the ring down, which
        // it does on a work queue after the thread ended: wait for that, so that whoever
        // opens the files next (this process again, or a takeover's successor told that they
        // are closed) finds them unlocked.
        for d in &self.config.dirs {
            crate::lock::wait_released(&d.path.join(SPILL_FILE_NAME), Duration::from_secs(5));
        }
    }
}
