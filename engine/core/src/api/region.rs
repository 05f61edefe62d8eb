//! Client memory regions: a client's memfd mapped shared, and block copies to and from it.
//!
//! A region is attached by a frame that carries the descriptor (SCM_RIGHTS); it lives until
//! `DetachRegion` or until the connection ends. Every `GetToRegion` / `PutFromRegion` is
//! validated as a whole (lengths, bounds, overlap, the descriptor's current size) before a
//! single byte moves, and a `GetToRegion` reply is sent only after all its writes are done.

use std::os::fd::{AsRawFd, OwnedFd};

use kvnode_proto::Key;
use kvnode_proto::client::{CommitStatus, ErrorCode, PutStatus, Reply};

use super::conn::Connection;
use super::handler::{invalid, tier_error};
use crate::tier::Reservation;

/// Most regions one connection may hold at once.
pub const MAX_REGIONS: usize = 16;

/// A client's memory, mapped shared into the daemon.
#[derive(Debug)]
pub struct Region {
    base: *mut u8,
    len: u64,
    fd: OwnedFd,
    /// `F_SEAL_SHRINK` is on the file: it can never shrink, so copies through the mapping
    /// cannot fault. Without the seal, copies go through pread/pwrite on the descriptor,
    /// which return an error (never SIGBUS) if the client truncates the file meanwhile.
    sealed: bool,
}

// SAFETY: plain shared memory owned by this connection; bytes are only touched through raw
// pointers inside validated extents while the connection's task runs the request.
unsafe impl Send for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no pointer into it outlives a request.
        unsafe { libc::munmap(self.base.cast(), self.len as usize) };
    }
}

fn fd_size(fd: &OwnedFd) -> std::io::Result<(u64, u32)> {
    // SAFETY: a zeroed stat is a valid out-parameter; fd is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.st_size as u64, st.st_mode))
}

impl Region {
    /// Validates and maps `len` bytes of `fd`.
    fn map(fd: OwnedFd, len: u64) -> Result<Self, String> {
        if len == 0 {
            return Err("AttachRegion len must be at least 1 byte".into());
        }
        let (size, mode) = fd_size(&fd).map_err(|e| format!("fstat of the descriptor: {e}"))?;
        if mode & libc::S_IFMT != libc::S_IFREG {
            return Err("the descriptor is not a memfd or regular file".into());
        }
        if size < len {
            return Err(format!(
                "the descriptor holds {size} bytes, fewer than the {len} bytes declared"
            ));
        }
        // SAFETY: mapping a valid descriptor of at least `len` bytes.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(format!(
                "cannot map the descriptor read-write ({e}): open it O_RDWR"
            ));
        }
        // SAFETY: fcntl on a valid descriptor; failure (no MFD_ALLOW_SEALING) is handled.
        let sealed = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0
            // SAFETY: as above.
            || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) } & libc::F_SEAL_SHRINK != 0;
        Ok(Self {
            base: base.cast(),
            len,
            fd,
            sealed,
        })
    }

    /// Whether copies may use the mapping (the file cannot shrink).
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// Writes `src` at `off` in the client's memory.
    fn write_at(&self, src: &[u8], off: u64) -> std::io::Result<()> {
        if self.sealed {
            // SAFETY: bounds were checked against the mapping, which cannot shrink (sealed);
            // destinations of one request do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off as usize), src.len());
            };
            return Ok(());
        }
        let (mut buf, mut at) = (src, off);
        while !buf.is_empty() {
            // SAFETY: pwrite from a valid buffer on a valid descriptor.
            let n = unsafe {
                libc::pwrite(
                    self.fd.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    at.cast_signed(),
                )
            };
            match n {
                n if n > 0 => {
                    buf = &buf[n as usize..];
                    at += n as u64;
                }
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Fills `dst` from `off` in the client's memory.
    fn read_at(&self, dst: &mut [u8], off: u64) -> std::io::Result<()> {
        if self.sealed {
            // SAFETY: as in `write_at`; the source extent was bounds-checked.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.base.add(off as usize),
                    dst.as_mut_ptr(),
                    dst.len(),
                );
            }
            return Ok(());
        }
        let (mut got, len) = (0usize, dst.len());
        while got < len {
            // SAFETY: pread into a valid buffer from a valid descriptor.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
                    dst[got..].as_mut_ptr().cast(),
                    len - got,
                    (off + got as u64).cast_signed(),
                )
            };
            match n {
                n if n > 0 => got += n as usize,
                0 => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the region's file shrank during the copy",
                    ));
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Refuses the request if the file shrank below the mapping (touching it would SIGBUS).
    fn still_whole(&self) -> Result<(), String> {
        match fd_size(&self.fd) {
            Ok((size, _)) if size >= self.len => Ok(()),
            Ok((size, _)) => Err(format!(
                "the region's descriptor shrank to {size} bytes below the {} mapped; detach and attach again",
                self.len
            )),
            Err(e) => Err(format!("fstat of the region's descriptor: {e}")),
        }
    }
}

/// Checks `offsets`/`lens` against the region; with `disjoint`, destinations may not overlap.
fn check_extents(
    region: &Region,
    keys: usize,
    offsets: &[u64],
    lens: &[u64],
    disjoint: bool,
) -> Result<(), String> {
    if offsets.len() != keys || lens.len() != keys {
        return Err(format!(
            "{keys} keys, {} offsets and {} lengths: give one offset and one length per key",
            offsets.len(),
            lens.len()
        ));
    }
    for (i, (&o, &l)) in offsets.iter().zip(lens).enumerate() {
        if o.checked_add(l).is_none_or(|end| end > region.len) {
            return Err(format!(
                "key {i}: extent [{o}, {o}+{l}) lies outside the {}-byte region",
                region.len
            ));
        }
    }
    if disjoint {
        let mut ext: Vec<(u64, u64)> = offsets.iter().copied().zip(lens.iter().copied()).collect();
        ext.sort_unstable();
        if let Some(w) = ext.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(format!(
                "destination extents overlap at offsets {} and {}",
                w[0].0, w[1].0
            ));
        }
    }
    region.still_whole()
}

/// Runs a long copy without stalling the runtime's other connections.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Connection {
    /// `AttachRegion`: maps the descriptor that came with this frame.
    pub(super) fn attach_region(&mut self, len: u64) -> Reply {
        let Some(fd) = self.io.take_fd() else {
            return invalid(
                "AttachRegion carries no descriptor: send the memfd with SCM_RIGHTS on this frame",
            );
        };
        if self.regions.len() >= MAX_REGIONS {
            return invalid(format!(
                "this connection already holds {MAX_REGIONS} regions: detach one first"
            ));
        }
        match Region::map(fd, len) {
            Ok(r) => {
                self.next_region += 1;
                let id = self.next_region;
                tracing::info!(
                    conn = self.id,
                    region = id,
                    len,
                    sealed = r.sealed(),
                    "client region attached"
                );
                self.regions.insert(id, r);
                Reply::RegionAttached { region: id, len }
            }
            Err(msg) => invalid(msg),
        }
    }

    /// `DetachRegion`.
    pub(super) fn detach_region(&mut self, region: u32) -> Reply {
        match self.regions.remove(&region) {
            Some(_) => Reply::RegionDetached,
            None => not_owned(region),
        }
    }

    /// Validates a request's extents against an attached region (before anything moves).
    fn check_region(
        &self,
        region: u32,
        n: usize,
        offsets: &[u64],
        lens: &[u64],
        dest: bool,
    ) -> Result<(), Reply> {
        let r = self.regions.get(&region).ok_or_else(|| not_owned(region))?;
        check_extents(r, n, offsets, lens, dest).map_err(invalid)
    }

    /// `GetToRegion`: lease every hit, validate, copy all, release, answer.
    pub(super) async fn get_to_region(
        &mut self,
        ns: u32,
        keys: &[Key],
        region: u32,
        offsets: &[u64],
        lens: &[u64],
    ) -> Reply {
        if let Err(reply) = self.check_region(region, keys.len(), offsets, lens, true) {
            return reply;
        }
        let mut leased = match self.engine.tier.lease(ns, keys) {
            Ok(l) => l,
            Err(e) => return tier_error(&e),
        };
        if let Some(t) = &self.engine.tiering {
            t.promote_misses(&self.engine, ns, keys, &mut leased).await;
        }
        let Some(r) = self.regions.get(&region) else {
            return not_owned(region);
        };
        let slots: Vec<_> = leased.iter().flatten().map(|l| l.slot).collect();
        let too_long = leased
            .iter()
            .zip(lens)
            .enumerate()
            .find(|(_, (l, room))| l.is_some_and(|b| b.extent.len > **room));
        let reply = if let Some((i, (l, room))) = too_long {
            let have = l.map_or(0, |b| b.extent.len);
            invalid(format!(
                "key {i}: stored block is {have} bytes but only {room} bytes of room were given; nothing was written"
            ))
        } else {
            let arena = &self.engine.arena;
            let copied = blocking(|| {
                for (l, &o) in leased.iter().zip(offsets) {
                    if let Some(b) = l {
                        // SAFETY: the block is leased (immutable) until the release below.
                        let src = unsafe { arena.slice(b.extent.offset, b.extent.len) };
                        r.write_at(src, o)?;
                    }
                }
                std::io::Result::Ok(())
            });
            match copied {
                Ok(()) => Reply::GotToRegion {
                    lens: leased.iter().map(|l| l.map(|b| b.extent.len)).collect(),
                    pull: None,
                },
                Err(e) => invalid(format!("writing into the client's region failed: {e}")),
            }
        };
        self.engine.tier.release(&slots);
        reply
    }

    /// `PutFromRegion`: reserve, copy from the client's pages into the slots, commit.
    pub(super) async fn put_from_region(
        &mut self,
        ns: u32,
        keys: &[Key],
        region: u32,
        offsets: &[u64],
        lens: &[u64],
    ) -> Reply {
        if let Err(reply) = self.check_region(region, keys.len(), offsets, lens, false) {
            return reply;
        }
        if let Some(t) = &self.engine.tiering {
            t.make_room(&self.engine, lens.iter().sum()).await;
        }
        let Some(r) = self.regions.get(&region) else {
            return not_owned(region);
        };
        let reserved = match self.engine.tier.reserve(self.id, ns, keys, lens) {
            Ok(v) => v,
            Err(e) => return tier_error(&e),
        };
        let held: Vec<Reservation> = reserved
            .iter()
            .filter_map(|x| x.as_ref().ok().copied())
            .collect();
        let arena = &self.engine.arena;
        let copied = blocking(|| {
            for (x, &o) in reserved.iter().zip(offsets) {
                if let Ok(res) = x {
                    // SAFETY: this connection holds the reservation (no one else touches the slot).
                    let dst = unsafe { arena.slice_mut(res.offset, res.len) };
                    r.read_at(dst, o)?;
                }
            }
            std::io::Result::Ok(())
        });
        if let Err(e) = copied {
            self.engine.tier.abort(self.id, &held);
            return invalid(format!("reading from the client's region failed: {e}"));
        }
        let mut committed = self.engine.tier.commit(self.id, &held).into_iter();
        let results = reserved
            .iter()
            .map(|x| match x {
                Err(status) => *status,
                Ok(_) => match committed.next() {
                    Some(CommitStatus::Committed) => PutStatus::Stored,
                    _ => PutStatus::Exists,
                },
            })
            .collect();
        Reply::Put { results }
    }
}

fn not_owned(region: u32) -> Reply {
    Reply::Error {
        code: ErrorCode::NotOwned,
        message: format!(
            "region {region} is not attached on this connection (attach it with AttachRegion first)"
        ),
    }
}
