//! Client memory regions: a client's memfd mapped shared, and block copies to and from it.
//!
//! A region is attached by a frame that carries the descriptor (SCM_RIGHTS); it lives until
//! `DetachRegion`, until the connection ends, or until a copy faults because the client shrank
//! its file (region_copy.rs: sealed / guarded / pread). Every `GetToRegion` / `PutFromRegion`
//! is validated as a whole (lengths, bounds, overlap) before a single byte moves, and a
//! `GetToRegion` reply is sent only after all its writes are done.

use kvnode_proto::Key;
use kvnode_proto::client::{CommitStatus, ErrorCode, PutStatus, Reply};

use super::conn::Connection;
use super::handler::{invalid, tier_error};
use super::region_copy::{CopyError, Region};
use crate::tier::Reservation;

/// Most regions one connection may hold at once.
pub const MAX_REGIONS: usize = 16;

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
    Ok(())
}

/// Runs a long copy without stalling the runtime's other connections.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Which way a region copy went: into the client's pages (get) or out of them (put).
#[derive(Clone, Copy)]
enum Dir {
    Get,
    Put,
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
        match Region::attach(
            fd,
            len,
            self.engine.config.region_copy == crate::config::RegionCopy::Guarded,
        ) {
            Ok(r) => {
                self.next_region += 1;
                let id = self.next_region;
                r.count(&self.engine.regions);
                tracing::info!(
                    conn = self.id,
                    region = id,
                    len,
                    mode = r.mode(),
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
        check_extents(r, n, offsets, lens, dest)
            .and_then(|()| r.still_whole())
            .map_err(invalid)
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
        let Some(r) = self.regions.get_mut(&region) else {
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
            let copies: Vec<(&[u8], u64)> = leased
                .iter()
                .zip(offsets)
                .filter_map(|(l, &o)| {
                    // SAFETY: the block is leased (immutable) until the release below.
                    l.map(|b| (unsafe { arena.slice(b.extent.offset, b.extent.len) }, o))
                })
                .collect();
            match blocking(|| r.write_all(&copies)) {
                Ok(()) => Reply::GotToRegion {
                    lens: leased.iter().map(|l| l.map(|b| b.extent.len)).collect(),
                    pull: None,
                },
                Err(e) => self.copy_failed(region, Dir::Get, &e),
            }
        };
        self.engine.tier.release(&slots);
        reply
    }

    /// The reply for a failed copy; a faulted region is detached (its mapping is gone).
    fn copy_failed(&mut self, region: u32, dir: Dir, e: &CopyError) -> Reply {
        let (what, outcome) = match dir {
            Dir::Get => (
                "writing into",
                "the destinations may hold part of the blocks",
            ),
            Dir::Put => ("reading from", "nothing was stored"),
        };
        let CopyError::Faulted(why) = e else {
            return invalid(format!("{what} the client's region failed: {e}"));
        };
        self.regions.remove(&region);
        self.engine.regions.fault();
        tracing::warn!(conn = self.id, pid = self.cred.pid, region, reason = %why, "client region faulted; detached");
        Reply::Error {
            code: ErrorCode::Invalid,
            message: format!(
                "{what} the client's region failed: {why}; {outcome} and region {region} is detached: keep the memfd at its attached size and attach it again"
            ),
        }
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
        let reserved = match self.engine.tier.reserve(self.id, ns, keys, lens) {
            Ok(v) => v,
            Err(e) => return tier_error(&e),
        };
        let held: Vec<Reservation> = reserved
            .iter()
            .filter_map(|x| x.as_ref().ok().copied())
            .collect();
        let Some(r) = self.regions.get_mut(&region) else {
            self.engine.tier.abort(self.id, &held);
            return not_owned(region);
        };
        let arena = &self.engine.arena;
        let mut copies: Vec<(&mut [u8], u64)> = reserved
            .iter()
            .zip(offsets)
            .filter_map(|(x, &o)| {
                // SAFETY: this connection holds the reservation (no one else touches the slot).
                x.as_ref()
                    .ok()
                    .map(|res| (unsafe { arena.slice_mut(res.offset, res.len) }, o))
            })
            .collect();
        if let Err(e) = blocking(|| r.read_all(&mut copies)) {
            drop(copies);
            self.engine.tier.abort(self.id, &held);
            return self.copy_failed(region, Dir::Put, &e);
        }
        drop(copies);
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
