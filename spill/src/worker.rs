//! The IO worker: one thread per spill file, owning its ring, regions and in-flight operations.

use crate::buf::{AlignedBuf, Arena, Mem};
use crate::engine::{Cqe, IoEngine, Sqe};
use crate::error::SpillError;
use crate::file::SpillFile;
use crate::format::{
    BlockHeader, HEADER_LEN, SECTOR, SummaryTrailer, encode_summary, payload_checksum, round_up,
};
use crate::key::SpillKey;
use crate::ops::{BufOp, Mark, MarkQueue, MissReason, Msg, ReadOutcome, UnitOp, WriteOutcome};
use crate::region::{Alloc, Placement, Regions};
use crate::stats::{Loc, Shared};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

/// Settings a worker needs from the tier configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkerSettings {
    pub index: u16,
    pub queue_depth: usize,
    pub max_block: usize,
    pub sync_interval: Option<Duration>,
    pub seal_on_shutdown: bool,
}

/// A block payload's write: from where, how long, through which registered buffer, and the
/// bounce copy that must live until the write completes.
struct WriteSource {
    ptr: *const u8,
    len: usize,
    fixed: Option<u16>,
    bounce: Option<AlignedBuf>,
}

/// Payloads up to this size (rounded to sectors) go down in one write with their header
/// sector, copied behind it into one buffer: half the write operations for small blocks,
/// whose flush and demotion a disk's operation rate bounds rather than its bytes (two writes
/// a block: 1 M blocks of 4 KiB took 15 s to flush on an H100 host's disk). Larger payloads
/// are written from where they are (no copy), after their own header write.
const JOIN_MAX: u64 = 64 << 10;

struct WriteFlight {
    key: SpillKey,
    op: BufOp<WriteOutcome>,
    header: BlockHeader,
    region: u32,
    hdr: AlignedBuf,
    bounce: Option<AlignedBuf>,
    wlen: u32,
    remaining: u8,
    /// Header and payload in one write of `wlen` bytes from `hdr` (small payloads).
    joined: bool,
    error: Option<std::io::Error>,
    evicted: Vec<SpillKey>,
}

struct ReadFlight {
    key: SpillKey,
    loc: Loc,
    op: BufOp<ReadOutcome>,
    bounce: Option<AlignedBuf>,
    dst: *mut u8,
    rlen: u32,
}

enum Flight {
    Write(Box<WriteFlight>),
    /// A delete or clear marker's sector write into a region.
    Mark(u32, AlignedBuf),
    Read(ReadFlight),
    Sync(Option<UnitOp>),
    SealSync(u32),
    SealWrite(u32, AlignedBuf),
}

/// Converts a completion result into an error if it is not exactly `want` bytes.
fn check(res: i32, want: u32) -> Result<(), std::io::Error> {
    match res {
        r if r < 0 => Err(std::io::Error::from_raw_os_error(-r)),
        r if r as u32 == want => Ok(()),
        r => Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            format!("short transfer: {r} of {want} bytes"),
        )),
    }
}

enum Deferred {
    Write(SpillKey, BufOp<WriteOutcome>),
    Mark(Mark),
}

pub(crate) struct Worker {
    set: WorkerSettings,
    file: SpillFile,
    engine: IoEngine,
    direct: bool,
    regions: Regions,
    shared: Arc<Shared>,
    arena: Arena,
    flights: Vec<Option<Flight>>,
    free_slots: Vec<usize>,
    outstanding: usize,
    active: usize,
    ready: Vec<Cqe>,
    /// Writes and marks waiting for a region (every region open, draining or sealing).
    deferred: VecDeque<Deferred>,
    marks: Arc<MarkQueue>,
    pool: Vec<AlignedBuf>,
    dirty: bool,
    last_sync: Instant,
}

impl Worker {
    pub fn new(
        set: WorkerSettings,
        file: SpillFile,
        engine: IoEngine,
        direct: bool,
        regions: Regions,
        shared: Arc<Shared>,
        marks: Arc<MarkQueue>,
    ) -> Self {
        Self {
            set,
            file,
            engine,
            direct,
            regions,
            shared,
            arena: Arena::default(),
            flights: Vec::new(),
            free_slots: Vec::new(),
            outstanding: 0,
            active: 0,
            ready: Vec::new(),
            deferred: VecDeque::new(),
            marks,
            pool: Vec::new(),
            dirty: false,
            last_sync: Instant::now(),
        }
    }

    /// Serves `rx` until every sender is gone, then shuts down (sealing if configured).
    pub fn run(mut self, rx: &Receiver<Msg>) {
        let mut cqes = Vec::new();
        let mut stopping = false;
        let mut phase = 0u8;
        let idle = self.set.sync_interval.unwrap_or(Duration::from_hours(1));
        loop {
            while !stopping && self.active < self.set.queue_depth {
                let msg = if self.outstanding > 0 {
                    match rx.try_recv() {
                        Ok(m) => m,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            stopping = true;
                            break;
                        }
                    }
                } else {
                    match rx.recv_timeout(idle) {
                        Ok(m) => m,
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => {
                            stopping = true;
                            break;
                        }
                    }
                };
                self.handle(msg);
            }
            // After the receive loop, so that marks queued before the tier was dropped are
            // written before a stop seals the open region.
            self.take_marks();
            if self.dirty
                && self
                    .set
                    .sync_interval
                    .is_some_and(|i| self.last_sync.elapsed() >= i)
            {
                self.push_sync(None);
            }
            if stopping && self.outstanding == 0 {
                phase += 1;
                let sealing = self.set.seal_on_shutdown && self.shared.poisoned().is_none();
                match phase {
                    1 if sealing => match self.regions.close_open() {
                        Some(r) => self.start_seal(r),
                        None => continue,
                    },
                    2 if sealing => self.push_sync(None),
                    _ => return,
                }
            }
            if self.outstanding > 0 {
                let min = usize::from(self.ready.is_empty());
                if let Err(e) = self.engine.wait(min, &mut cqes) {
                    self.shared.poison(&format!(
                        "io engine wait on {} failed: {e}",
                        self.file.path.display()
                    ));
                    return;
                }
                cqes.append(&mut self.ready);
                for c in cqes.drain(..) {
                    self.outstanding -= 1;
                    self.complete(c);
                }
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        self.take_marks();
        self.active += 1;
        match msg {
            Msg::Wake => self.active -= 1,
            Msg::Write { key, op } => self.start_write(key, op),
            Msg::Read { key, loc, op } => self.start_read(key, loc, op),
            Msg::Sync(op) => self.push_sync(Some(op)),
            Msg::Arena { arena, op } if !arena.registered => {
                // Attached only: transfers resolve against it, without fixed buffers.
                self.active -= 1;
                self.arena = arena;
                op.finish(Ok(()));
            }
            Msg::Arena { arena, op } => {
                // SAFETY: `SpillTier::register_arena`'s contract keeps the arena mapped for the
                // tier's lifetime, which outlives this worker.
                let r = unsafe { self.engine.register_buffers(&arena.pieces()) };
                self.active -= 1;
                match r {
                    Ok(()) => {
                        self.arena = arena;
                        op.finish(Ok(()));
                    }
                    Err(e) => op.finish(Err(SpillError::io(
                        "registering arena buffers",
                        &self.file.path,
                        e,
                    ))),
                }
            }
        }
    }

    fn slot(&mut self, f: Flight) -> u64 {
        let s = if let Some(s) = self.free_slots.pop() {
            self.flights[s] = Some(f);
            s
        } else {
            self.flights.push(Some(f));
            self.flights.len() - 1
        };
        (s as u64) << 1
    }

    fn push(&mut self, token: u64, sqe: Sqe) {
        self.outstanding += 1;
        if self.engine.push(token, sqe).is_err() {
            self.ready.push(Cqe {
                token,
                res: -libc::EIO,
            });
        }
    }

    fn take_buf(&mut self, len: usize) -> AlignedBuf {
        let mut b = match self.pool.iter().position(|b| b.capacity() >= len) {
            Some(i) => self.pool.swap_remove(i),
            None => AlignedBuf::zeroed(len),
        };
        b.set_len(len);
        b
    }

    fn give_buf(&mut self, b: AlignedBuf) {
        if self.pool.len() < 2 * self.set.queue_depth + 4 {
            self.pool.push(b);
        }
    }

    fn push_sync(&mut self, op: Option<UnitOp>) {
        self.dirty = false;
        self.last_sync = Instant::now();
        let t = self.slot(Flight::Sync(op));
        self.push(t, Sqe::Fsync);
    }

    fn start_write(&mut self, key: SpillKey, mut op: BufOp<WriteOutcome>) {
        if let Some(reason) = self.shared.poisoned() {
            return self.finish_write(op, Err(SpillError::Poisoned { reason }));
        }
        let mem = match op.buf_mut().region(&self.arena, None) {
            Ok(m) => m,
            Err(e) => return self.finish_write(op, Err(e)),
        };
        let len = mem.len;
        if len > self.set.max_block {
            return self.finish_write(
                op,
                Err(SpillError::TooLarge {
                    len,
                    max: self.set.max_block,
                }),
            );
        }
        let extent = SECTOR + round_up(len as u64);
        let Some((p, evicted)) = self.place(extent) else {
            return self.deferred.push_back(Deferred::Write(key, op));
        };
        let seq = self.shared.next_seq();
        // SAFETY: the buffer's owner guaranteed `len` readable bytes that nobody modifies
        // until this operation completes (IoBuf / register_arena contracts).
        let payload = unsafe { std::slice::from_raw_parts(mem.ptr, len) };
        let header = BlockHeader {
            kind: crate::format::RecordKind::Block,
            seq,
            region_gen: p.generation,
            file_offset: p.file_offset,
            key,
            payload_len: len as u32,
            payload_checksum: payload_checksum(payload, seq),
        };
        self.regions.push_entry(p.region, header);
        if round_up(len as u64) <= JOIN_MAX {
            return self.write_joined(key, op, header, p.region, payload, evicted);
        }
        let mut hdr = self.take_buf(SECTOR as usize);
        hdr.fill(0);
        hdr[..HEADER_LEN].copy_from_slice(&header.encode());
        let src = self.write_source(&mem, payload);
        let hdr_ptr = hdr.as_ptr();
        let remaining = if src.len > 0 { 2 } else { 1 };
        let f = WriteFlight {
            key,
            op,
            header,
            region: p.region,
            hdr,
            bounce: src.bounce,
            wlen: src.len as u32,
            remaining,
            joined: false,
            error: None,
            evicted,
        };
        let t = self.slot(Flight::Write(Box::new(f)));
        self.push(
            t,
            Sqe::Write {
                buf: hdr_ptr,
                len: SECTOR as u32,
                offset: p.file_offset,
                fixed: None,
            },
        );
        if src.len > 0 {
            self.push(
                t | 1,
                Sqe::Write {
                    buf: src.ptr,
                    len: src.len as u32,
                    offset: p.file_offset + SECTOR,
                    fixed: src.fixed,
                },
            );
        }
    }

    /// A small block: its header sector and its payload (zero-padded to a sector) copied into
    /// one buffer and written together.
    fn write_joined(
        &mut self,
        key: SpillKey,
        op: BufOp<WriteOutcome>,
        header: BlockHeader,
        region: u32,
        payload: &[u8],
        evicted: Vec<SpillKey>,
    ) {
        let sector = SECTOR as usize;
        let total = sector + round_up(payload.len() as u64) as usize;
        let mut buf = self.take_buf(total);
        buf.fill(0);
        buf[..HEADER_LEN].copy_from_slice(&header.encode());
        buf[sector..sector + payload.len()].copy_from_slice(payload);
        let ptr = buf.as_ptr();
        let offset = header.file_offset;
        let f = WriteFlight {
            key,
            op,
            header,
            region,
            hdr: buf,
            bounce: None,
            wlen: total as u32,
            remaining: 1,
            joined: true,
            error: None,
            evicted,
        };
        let t = self.slot(Flight::Write(Box::new(f)));
        self.push(
            t,
            Sqe::Write {
                buf: ptr,
                len: total as u32,
                offset,
                fixed: None,
            },
        );
    }

    /// Where a block's payload is written from: the caller's memory when it may be (buffered
    /// I/O, or O_DIRECT with sector alignment), else a sector-aligned bounce copy.
    fn write_source(&mut self, mem: &Mem, payload: &[u8]) -> WriteSource {
        let len = payload.len();
        let aligned = (mem.ptr as usize).is_multiple_of(SECTOR as usize)
            && len.is_multiple_of(SECTOR as usize);
        if !self.direct || aligned {
            return WriteSource {
                ptr: mem.ptr.cast_const(),
                len,
                fixed: if self.direct { mem.fixed } else { None },
                bounce: None,
            };
        }
        let mut b = self.take_buf(round_up(len as u64) as usize);
        b[..len].copy_from_slice(payload);
        b[len..].fill(0);
        Shared::bump(&self.shared.counters.bounce_copies, 1);
        WriteSource {
            ptr: b.as_ptr(),
            len: b.len(),
            fixed: None,
            bounce: Some(b),
        }
    }

    /// Finds room for `extent` bytes in the file: seals the region that filled and evicts
    /// what a reclaim took. `None` when every region is open, draining or sealing: the caller
    /// defers its operation until a seal completes.
    fn place(&mut self, extent: u64) -> Option<(Placement, Vec<SpillKey>)> {
        let shared = self.shared.clone();
        let p = match self.regions.alloc(extent, || shared.next_seq()) {
            Alloc::Placed(p) => p,
            Alloc::Busy { seal } => {
                if let Some(s) = seal {
                    self.start_seal(s);
                }
                return None;
            }
        };
        if let Some(s) = p.seal {
            self.start_seal(s);
        }
        let evicted = self.evict(&p.reclaimed);
        Some((p, evicted))
    }

    fn take_marks(&mut self) {
        for m in self.marks.take() {
            self.active += 1;
            self.start_mark(m);
        }
    }

    /// Writes a delete or clear marker: one sector, placed like a block.
    fn start_mark(&mut self, m: Mark) {
        if self.shared.poisoned().is_some() {
            // Nothing is written to a poisoned tier; its next start recovers what is on disk.
            self.active -= 1;
            return;
        }
        let Some((p, evicted)) = self.place(SECTOR) else {
            return self.deferred.push_back(Deferred::Mark(m));
        };
        self.shared.orphans.extend(evicted);
        let seq = self.shared.next_seq();
        let h = BlockHeader::marker(m.kind, m.key, seq, p.generation, p.file_offset);
        self.regions.push_entry(p.region, h);
        let mut buf = self.take_buf(SECTOR as usize);
        buf.fill(0);
        buf[..HEADER_LEN].copy_from_slice(&h.encode());
        let ptr = buf.as_ptr();
        let t = self.slot(Flight::Mark(p.region, buf));
        self.push(
            t,
            Sqe::Write {
                buf: ptr,
                len: SECTOR as u32,
                offset: p.file_offset,
                fixed: None,
            },
        );
    }

    fn mark_done(&mut self, region: u32, buf: AlignedBuf, res: i32) {
        self.active -= 1;
        if let Some(s) = self.regions.write_done(region) {
            self.start_seal(s);
        }
        self.give_buf(buf);
        match check(res, SECTOR as u32) {
            Ok(()) => {
                Shared::bump(&self.shared.counters.marks, 1);
                self.dirty = true;
            }
            Err(e) => {
                Shared::bump(&self.shared.counters.errors, 1);
                self.poison(&format!(
                    "delete marker write to {} failed: {e}",
                    self.file.path.display()
                ));
            }
        }
    }

    /// Runs the writes and marks that waited for a region.
    fn run_deferred(&mut self) {
        let n = self.deferred.len();
        for _ in 0..n {
            match self.deferred.pop_front() {
                Some(Deferred::Write(k, op)) => self.start_write(k, op),
                Some(Deferred::Mark(m)) => self.start_mark(m),
                None => break,
            }
        }
    }

    fn evict(&mut self, reclaimed: &[BlockHeader]) -> Vec<SpillKey> {
        if reclaimed.is_empty() {
            return Vec::new();
        }
        let mut idx = self.shared.index();
        let keys: Vec<SpillKey> = reclaimed
            .iter()
            .filter(|h| !h.kind.is_marker() && idx.remove_if(&h.key, self.set.index, h.seq))
            .map(|h| h.key)
            .collect();
        drop(idx);
        Shared::bump(&self.shared.counters.evictions, keys.len() as u64);
        keys
    }

    fn finish_write(&mut self, op: BufOp<WriteOutcome>, r: Result<WriteOutcome, SpillError>) {
        self.active -= 1;
        op.finish(r);
    }

    fn finish_read(&mut self, op: BufOp<ReadOutcome>, r: Result<ReadOutcome, SpillError>) {
        self.active -= 1;
        let c = &self.shared.counters;
        match &r {
            Ok(ReadOutcome::Hit { len }) => {
                Shared::bump(&c.hits, 1);
                Shared::bump(&c.read_bytes, *len as u64);
            }
            _ => Shared::bump(&c.misses, 1),
        }
        Shared::bump(&c.reads, 1);
        op.finish(r);
    }

    fn start_read(&mut self, key: SpillKey, loc: Loc, mut op: BufOp<ReadOutcome>) {
        if !self.regions.is_current(loc.region, loc.generation) {
            return self.finish_read(op, Ok(ReadOutcome::Miss(MissReason::Evicted)));
        }
        let len = loc.len as usize;
        let full = round_up(len as u64) as usize;
        let mem = match op
            .buf_mut()
            .region(&self.arena, Some(if self.direct { full } else { len }))
        {
            Ok(m) => m,
            Err(e) => return self.finish_read(op, Err(e)),
        };
        if mem.len < len {
            return self.finish_read(
                op,
                Err(SpillError::BufferTooSmall {
                    needed: len,
                    capacity: mem.len,
                }),
            );
        }
        let aligned = (mem.ptr as usize).is_multiple_of(SECTOR as usize) && mem.len >= full;
        let (dst, rlen, fixed, bounce) = if !self.direct {
            (mem.ptr, len, None, None)
        } else if aligned {
            (mem.ptr, full, mem.fixed, None)
        } else {
            let mut b = self.take_buf(full);
            Shared::bump(&self.shared.counters.bounce_copies, 1);
            (b.as_mut_ptr(), full, None, Some(b))
        };
        let t = self.slot(Flight::Read(ReadFlight {
            key,
            loc,
            op,
            bounce,
            dst: mem.ptr,
            rlen: rlen as u32,
        }));
        if rlen == 0 {
            self.outstanding += 1;
            self.ready.push(Cqe { token: t, res: 0 });
            return;
        }
        self.push(
            t,
            Sqe::Read {
                buf: dst,
                len: rlen as u32,
                offset: loc.offset + SECTOR,
                fixed,
            },
        );
    }

    fn complete(&mut self, c: Cqe) {
        let slot = (c.token >> 1) as usize;
        let Some(flight) = self.flights[slot].take() else {
            return;
        };
        match flight {
            Flight::Write(mut w) => {
                let want = if c.token & 1 == 0 && !w.joined {
                    SECTOR as u32
                } else {
                    w.wlen
                };
                if let Err(e) = check(c.res, want) {
                    w.error.get_or_insert(e);
                }
                w.remaining -= 1;
                if w.remaining > 0 {
                    self.flights[slot] = Some(Flight::Write(w));
                    return;
                }
                self.free_slots.push(slot);
                self.write_done(*w);
            }
            Flight::Read(r) => {
                self.free_slots.push(slot);
                self.read_done(r, c.res);
            }
            Flight::Mark(region, buf) => {
                self.free_slots.push(slot);
                self.mark_done(region, buf, c.res);
            }
            Flight::Sync(op) => {
                self.free_slots.push(slot);
                let r = check(c.res, 0).map_err(|e| {
                    Shared::bump(&self.shared.counters.errors, 1);
                    self.poison(&format!(
                        "fdatasync of {} failed: {e}",
                        self.file.path.display()
                    ));
                    SpillError::io("fdatasync", &self.file.path, e)
                });
                if r.is_ok() {
                    Shared::bump(&self.shared.counters.syncs, 1);
                }
                if let Some(op) = op {
                    self.active -= 1;
                    op.finish(r);
                }
            }
            Flight::SealSync(r) => {
                self.free_slots.push(slot);
                self.seal_synced(r, c.res);
            }
            Flight::SealWrite(r, buf) => {
                self.free_slots.push(slot);
                match check(c.res, buf.len() as u32) {
                    Ok(()) => {
                        self.regions.seal_done(r);
                        self.run_deferred();
                    }
                    Err(e) => {
                        Shared::bump(&self.shared.counters.errors, 1);
                        self.poison(&format!(
                            "writing region summary in {} failed: {e}",
                            self.file.path.display()
                        ));
                    }
                }
            }
        }
    }

    fn write_done(&mut self, w: WriteFlight) {
        if let Some(s) = self.regions.write_done(w.region) {
            self.start_seal(s);
        }
        let WriteFlight {
            key,
            op,
            header,
            region,
            hdr,
            bounce,
            error,
            evicted,
            ..
        } = w;
        self.give_buf(hdr);
        if let Some(b) = bounce {
            self.give_buf(b);
        }
        if let Some(e) = error {
            Shared::bump(&self.shared.counters.errors, 1);
            let at = header.file_offset;
            self.poison(&format!(
                "block write to {} at offset {at} failed: {e}",
                self.file.path.display()
            ));
            return self.finish_write(op, Err(SpillError::io("writing block", &self.file.path, e)));
        }
        let loc = Loc {
            file: self.set.index,
            region,
            generation: header.region_gen,
            offset: header.file_offset,
            len: header.payload_len,
            seq: header.seq,
            checksum: header.payload_checksum,
        };
        self.shared.index().insert_if_newer(key, loc);
        let c = &self.shared.counters;
        Shared::bump(&c.writes, 1);
        Shared::bump(&c.write_bytes, u64::from(header.payload_len));
        self.dirty = true;
        self.finish_write(
            op,
            Ok(WriteOutcome {
                seq: header.seq,
                evicted,
            }),
        );
    }

    fn read_done(&mut self, r: ReadFlight, res: i32) {
        let ReadFlight {
            key,
            loc,
            mut op,
            bounce,
            dst,
            rlen,
        } = r;
        let len = loc.len as usize;
        let outcome = if res < 0 {
            Shared::bump(&self.shared.counters.errors, 1);
            let e = std::io::Error::from_raw_os_error(-res);
            tracing::warn!(path = %self.file.path.display(), offset = loc.offset, error = %e, "spill read failed");
            ReadOutcome::Miss(MissReason::Io)
        } else {
            let src = bounce.as_ref().map_or(dst.cast_const(), |b| b.as_ptr());
            // SAFETY: `src` holds `rlen >= len` bytes owned by this operation.
            let data = unsafe { std::slice::from_raw_parts(src, len) };
            if res as usize >= len.min(rlen as usize)
                && payload_checksum(data, loc.seq) == loc.checksum
            {
                if bounce.is_some() {
                    // SAFETY: `dst` has room for `len` bytes (checked at submit) and does not
                    // overlap the bounce buffer.
                    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                }
                op.buf_mut().trim_after_read(len);
                ReadOutcome::Hit { len }
            } else if !self.regions.is_current(loc.region, loc.generation) {
                ReadOutcome::Miss(MissReason::Evicted)
            } else {
                Shared::bump(&self.shared.counters.checksum_failures, 1);
                self.shared.index().remove_if(&key, self.set.index, loc.seq);
                tracing::warn!(path = %self.file.path.display(), offset = loc.offset, got = res, "spill block failed verification (short read or checksum); dropped");
                ReadOutcome::Miss(MissReason::Corrupt)
            }
        };
        if let Some(b) = bounce {
            self.give_buf(b);
        }
        self.finish_read(op, Ok(outcome));
    }

    fn poison(&mut self, reason: &str) {
        self.shared.poison(reason);
        while let Some(d) = self.deferred.pop_front() {
            match d {
                Deferred::Write(_, op) => self.finish_write(
                    op,
                    Err(SpillError::Poisoned {
                        reason: reason.to_owned(),
                    }),
                ),
                Deferred::Mark(_) => self.active -= 1,
            }
        }
    }

    fn start_seal(&mut self, r: u32) {
        if self.shared.poisoned().is_some() {
            return;
        }
        let t = self.slot(Flight::SealSync(r));
        self.push(t, Sqe::Fsync);
    }

    /// The region's blocks are durable: write its summary.
    fn seal_synced(&mut self, r: u32, res: i32) {
        if let Err(e) = check(res, 0) {
            Shared::bump(&self.shared.counters.errors, 1);
            return self.poison(&format!(
                "fdatasync before sealing a region of {} failed: {e}",
                self.file.path.display()
            ));
        }
        let g = self.regions.region(r);
        let body = SummaryTrailer::entries_len(g.entries.len() as u32);
        let mut buf = AlignedBuf::zeroed((body + SECTOR) as usize);
        encode_summary(g.generation, &g.entries, &mut buf);
        let offset = self.regions.end(r) - body - SECTOR;
        let (ptr, len) = (buf.as_ptr(), buf.len() as u32);
        let t = self.slot(Flight::SealWrite(r, buf));
        self.push(
            t,
            Sqe::Write {
                buf: ptr,
                len,
                offset,
                fixed: None,
            },
        );
    }
}
