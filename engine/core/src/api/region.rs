//! Client memory regions: a client's memfd mapped shared, and block copies to and from it.
//!
//! A region is attached by a frame that carries the descriptor (SCM_RIGHTS); it lives until
//! `DetachRegion`, until the connection ends, or until a copy faults because the client shrank
//! its file (region_copy.rs: sealed / guarded / pread). Every `GetToRegion` / `PutFromRegion`
//! is validated as a whole (lengths, bounds, overlap) before a single byte moves, and a
//! `GetToRegion` reply is sent only after all its writes are done. With a hint, each run of
//! pulled keys is copied into the region as soon as it has landed, not after the whole pull.

use std::ops::Range;
use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::{CommitStatus, ErrorCode, Op, PutStatus, Reply};

use super::errors::{error, invalid, tier_error};
use super::listed_op::ListedOp;
use super::region_copy::{CopyError, Region};
use super::session::Session;
use crate::peer::{Arrivals, PullRequest};
use crate::store::{Delivery, Got, Lease};

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

/// Where a `GetToRegion` writes: the region and each key's offset and room.
struct Dest<'a> {
    region: u32,
    offsets: &'a [u64],
    lens: &'a [u64],
}

/// Which way a region copy went: into the client's pages (get) or out of them (put, with
/// the number of leading keys already handled before the failed run).
#[derive(Clone, Copy)]
enum Dir {
    Get,
    Put(usize),
}

impl Session {
    /// `AttachRegion`, `DetachRegion`, `GetToRegion` (with a hint: streamed as the pull lands),
    /// `PutFromRegion`.
    pub(super) async fn region_op(&mut self, op: Op) -> Reply {
        match op {
            Op::AttachRegion { len } => self.attach_region(len),
            Op::DetachRegion { region } => self.detach_region(region),
            Op::GetToRegion {
                ns,
                keys,
                region,
                offsets,
                lens,
                hint,
                deadline_ms,
            } => {
                let to = Dest {
                    region,
                    offsets: &offsets,
                    lens: &lens,
                };
                match hint {
                    Some(h) => {
                        self.get_to_region_pulled(ns, &keys, &to, &h, deadline_ms)
                            .await
                    }
                    None => self.get_to_region(ns, &keys, &to).await,
                }
            }
            Op::PutFromRegion {
                ns,
                keys,
                region,
                offsets,
                lens,
            } => {
                self.put_from_region(ns, &keys, region, &offsets, &lens)
                    .await
            }
            other => unreachable!("region_op got {other:?}"),
        }
    }

    /// `AttachRegion`: maps the descriptor that came with this frame.
    fn attach_region(&mut self, len: u64) -> Reply {
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
        // Charged before the mapping is made: a uid at its cap costs no mapping.
        let charge = match self.charge(crate::tenant::Held::Regions, 1) {
            Ok(c) => c,
            Err(over) => return error(ErrorCode::LimitReached, over.to_string()),
        };
        match Region::attach(
            fd,
            len,
            self.engine.config.region_copy == crate::config::RegionCopy::Guarded,
        ) {
            Ok(mut r) => {
                r.charge = Some(charge);
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
    fn detach_region(&mut self, region: u32) -> Reply {
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

    /// `GetToRegion`: validate, then window by window in prefix order (store/get.rs): lease
    /// (promoting from NVMe), copy into the region, release; answer after the last copy.
    /// DRAM use is one window whatever the get's length.
    async fn get_to_region(&mut self, ns: u32, keys: &[Key], to: &Dest<'_>) -> Reply {
        if let Err(reply) = self.check_region(to.region, keys.len(), to.offsets, to.lens, true) {
            return reply;
        }
        let mut got: Vec<Option<u64>> = vec![None; keys.len()];
        match self
            .copy_to_region(ns, keys, to, 0..keys.len(), &mut got)
            .await
        {
            Ok(_) => Reply::GotToRegion {
                lens: got,
                pull: None,
            },
            Err(reply) => reply,
        }
    }

    /// `GetToRegion` with a hint: validate, start the pull, and copy each run of leading keys
    /// into the region as soon as it has landed (local hits first), while later blocks are
    /// still on the wire ([`Arrivals`]). The reply, after the last copy, carries the pull's
    /// report. Blocks that land after the answer (past the deadline, or after a copy stopped
    /// the prefix) stay in the DRAM tier.
    async fn get_to_region_pulled(
        &mut self,
        ns: u32,
        keys: &[Key],
        to: &Dest<'_>,
        hint: &str,
        deadline_ms: Option<u64>,
    ) -> Reply {
        if let Err(reply) = self.check_region(to.region, keys.len(), to.offsets, to.lens, true) {
            return reply;
        }
        let req = PullRequest {
            deadline_ms,
            ..self.request(ns, keys, hint).await
        };
        let peers = Arc::clone(&self.engine.peers);
        let op = peers.start(req).await;
        let op = ListedOp::new(peers, op);
        let mut arrivals = Arrivals::new(Arc::clone(op.op()));
        let mut got: Vec<Option<u64>> = vec![None; keys.len()];
        while let Some(run) = arrivals.next_run().await {
            match self.copy_to_region(ns, keys, to, run, &mut got).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(reply) => return reply,
            }
        }
        Reply::GotToRegion {
            lens: got,
            pull: Some(Box::new(op.report())),
        }
    }

    /// Copies keys `range` into the region, window by window; records each key's length in
    /// `got`. Ok(false): a key the plan held could not be leased (DRAM full of leases), so the
    /// answer ends before it and nothing after it is copied.
    async fn copy_to_region(
        &mut self,
        ns: u32,
        all: &[Key],
        to: &Dest<'_>,
        range: Range<usize>,
        got: &mut [Option<u64>],
    ) -> Result<bool, Reply> {
        let (keys, lens, offsets) = (
            &all[range.clone()],
            &to.lens[range.clone()],
            &to.offsets[range.clone()],
        );
        let written = if range.start == 0 {
            "nothing was written".to_owned()
        } else {
            format!("the {} keys before it were written", range.start)
        };
        let store = Arc::clone(&self.engine.store);
        let mut prefix = store
            .prefix(ns, keys, Delivery::Stream)
            .map_err(|e| tier_error(&e))?;
        // Checked on the plan, before a byte moves (a block's length never changes).
        let too_long = prefix
            .plan()
            .iter()
            .zip(lens)
            .enumerate()
            .find(|(_, (p, room))| p.0.is_local() && p.1 > **room);
        if let Some((i, (p, room))) = too_long {
            return Err(invalid(format!(
                "key {}: stored block is {} bytes but only {room} bytes of room were given; {written}",
                range.start + i,
                p.1
            )));
        }
        while let Some(w) = prefix.next().await.map_err(|e| tier_error(&e))? {
            let Some(r) = self.regions.get_mut(&to.region) else {
                return Err(not_owned(to.region));
            };
            let leased: Vec<(usize, &Lease)> = w
                .range()
                .zip(&w.got)
                .filter_map(|(i, g)| match g {
                    Got::Leased(l) => Some((i, l)),
                    Got::Miss | Got::NoRoom => None,
                })
                .collect();
            if let Some(&(i, b)) = leased.iter().find(|(i, b)| b.len() > lens[*i]) {
                // Only a key written again with a new length between plan and lease.
                return Err(invalid(format!(
                    "key {}: stored block is {} bytes but only {} bytes of room were given",
                    range.start + i,
                    b.len(),
                    lens[i]
                )));
            }
            // Every block stays leased (immutable) until `w` drops after the copies.
            let copies: Vec<(&[u8], u64)> = leased
                .iter()
                .map(|&(i, b)| (b.bytes(), offsets[i]))
                .collect();
            let t0 = std::time::Instant::now();
            if let Err(e) = blocking(|| r.write_all(&copies)) {
                return Err(self.copy_failed(to.region, Dir::Get, &e));
            }
            let bytes = copies.iter().map(|c| c.0.len() as u64).sum();
            let costs = &self.engine.metrics.costs;
            costs.record(crate::obs::cost::DRAM_REGION, bytes, t0.elapsed());
            for &(i, b) in &leased {
                got[range.start + i] = Some(b.len());
            }
            if let Some(end) = w.end() {
                // No room for this window's promotion (DRAM is full of leased blocks): the
                // answer is the prefix copied so far, never a hole in front of later pages.
                got[range.start + end..].iter_mut().for_each(|g| *g = None);
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The reply for a failed copy; a faulted region is detached (its mapping is gone).
    fn copy_failed(&mut self, region: u32, dir: Dir, e: &CopyError) -> Reply {
        let (what, outcome) = match dir {
            Dir::Get => (
                "writing into",
                "the destinations may hold part of the blocks".to_owned(),
            ),
            Dir::Put(0) => ("reading from", "nothing was stored".to_owned()),
            Dir::Put(n) => (
                "reading from",
                format!("the first {n} keys were stored, none after them"),
            ),
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
    async fn put_from_region(
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
        let store = Arc::clone(&self.engine.store);
        let mut results = Vec::with_capacity(keys.len());
        // Run by run, each waiting for DRAM room (see `Store::put_runs`).
        for run in store.put_runs(lens) {
            let (ks, ls, os) = (
                &keys[run.clone()],
                &lens[run.clone()],
                &offsets[run.clone()],
            );
            store.make_room(ls.iter().sum()).await;
            let mut reserved = match store.reserve(self.id, ns, ks, ls) {
                Ok(v) => v,
                Err(e) => return tier_error(&e),
            };
            let Some(r) = self.regions.get_mut(&region) else {
                return not_owned(region);
            };
            let mut copies: Vec<(&mut [u8], u64)> = reserved
                .iter_mut()
                .zip(os)
                .filter_map(|(x, &o)| x.as_mut().ok().map(|res| (res.bytes_mut(), o)))
                .collect();
            if let Err(e) = blocking(|| r.read_all(&mut copies)) {
                // Dropping `reserved` frees this run's slots; earlier runs are stored.
                drop(copies);
                return self.copy_failed(region, Dir::Put(results.len()), &e);
            }
            drop(copies);
            results.extend(reserved.into_iter().map(|x| match x {
                Err(status) => status,
                Ok(res) => match res.commit() {
                    CommitStatus::Committed => PutStatus::Stored,
                    _ => PutStatus::Exists,
                },
            }));
        }
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
