//! Destination side: per-peer connection pools and the pull of one chunk of an op's keys.
//!
//! A chunk is pulled by one blocking-pool thread that owns its connection, so the kernel
//! wakes that thread directly as bytes arrive (no runtime hop between reads). A small pull
//! its client's request awaits is pulled in place, on the request's own worker thread (no
//! hop back to the runtime either; [`Chunk::pull_blocking`]). Bytes are
//! read by the transport straight into DRAM slots this daemon reserved, hashed (BLAKE3)
//! piece by piece while still in cache, checked against the hash in the block's sealed
//! header, and committed whether or not the op is still waiting: nothing completed is thrown
//! away. Only then, under the op's fence, are they copied into client buffers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvnode_proto::NamespaceId;
use kvnode_proto::client::{CommitStatus, PutStatus};
use kvnode_proto::peer::{HASH_LEN, PeerMsg, PullKey};
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome};

use super::error::{HandshakeError, PullError, Verbatim, Violation};
use super::hashes::{SlotId, Sums, fingerprint};
use super::op::PullOp;
use super::transport::{PullConn as _, PullWire, SlotReads as _};
use super::{PeerError, Peers};

mod check;
mod gets;
mod hash_ahead;
mod link;

use check::{Checked, read_checked, read_hashed};
use gets::{Flight, Landing};
use hash_ahead::HashAhead;
pub use link::PeerLink;
use link::stale;

/// Where a block's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body<'a> {
    /// The payload that follows the `Block` frame, with its AEAD tag (empty unless encrypted).
    Inline(&'a [u8]),
    /// A UCX GET of the source's slot at this address, with the block MAC its `Slot` carried
    /// (empty when none).
    Remote(u64, &'a [u8]),
}

/// A block answer: op key `i` of request `req`, `len` bytes, and where they come from.
#[derive(Clone, Copy, Debug)]
struct Answer<'a> {
    i: usize,
    req: u64,
    len: u32,
    body: Body<'a>,
}

/// When a pull's blocks came, from its requests' send: the first, the last, and how many
/// (`stats`: first-block latency and the gap per further block).
struct Timing {
    sent: Instant,
    first: Option<Duration>,
    last: Duration,
    blocks: u32,
    page: u64,
}

impl Timing {
    fn since(sent: Instant) -> Self {
        Self {
            sent,
            first: None,
            last: sent.elapsed(),
            blocks: 0,
            page: 0,
        }
    }

    /// A block of `len` bytes came now.
    fn block(&mut self, len: u32) {
        let now = self.sent.elapsed();
        self.first.get_or_insert(now);
        self.last = now;
        self.blocks += 1;
        self.page = u64::from(len);
    }

    fn record(&self, p: &Peers, peer: &str) {
        if let Some(f) = self.first {
            let per = (self.blocks > 1).then(|| self.last.saturating_sub(f) / (self.blocks - 1));
            p.stats.record(peer, self.page, f, per);
        }
    }
}

struct Chunk {
    peers: Arc<Peers>,
    link: Arc<PeerLink>,
    op: Arc<PullOp>,
    /// Keys of this chunk not yet answered (op key indices); a key whose GET is in flight
    /// stays here until it lands.
    open: Vec<usize>,
    /// Blocks whose UCX GET is in flight, by op key index (the GET's tag).
    flights: HashMap<usize, Flight>,
    /// The thread hashing large TCP blocks while they are received (started at the first).
    ahead: Option<HashAhead>,
    /// Requests already sent from the runtime task ([`Chunk::send_early`]): their keys by
    /// request id, and when they left.
    sent: Option<(Requests, Instant)>,
    /// Received on the calling worker thread itself (see [`Chunk::pull_blocking`]).
    in_place: bool,
    /// Longest wait for the peer without progress: the io timeout, and for an in-place
    /// pull no longer than what was left of the op's deadline when it started.
    io: Duration,
}

/// A pull awaited by its client's request with at most this many keys is received in place.
pub const IN_PLACE_KEYS: usize = 4;

/// Keys (op key indices) of each `Pull` request sent, by request id.
type Requests = HashMap<u64, Vec<usize>>;

/// Pulls op keys `idxs` from `link`, bounded by its connection permits and timeouts.
/// `in_place`: a small pull awaited by the client's own request, received on the calling
/// worker thread (see [`Chunk::pull_blocking`]).
pub async fn run_chunk(
    peers: Arc<Peers>,
    link: Arc<PeerLink>,
    op: Arc<PullOp>,
    idxs: Vec<usize>,
    in_place: bool,
) {
    let n = idxs.len() as u64;
    // Releases the chunk's keys from the link's in-flight count however the pull ends
    // (also if its future is dropped unfinished).
    let _in_flight = InFlight(Arc::clone(&link), n);
    let peer_idx = (crate::probes::hash_name(&link.name) & 0xffff_ffff) as u32;
    crate::probes::peer_pull_start(peer_idx, op.id, n as u32);
    let t0 = peers.metrics().now_ns();
    let io = if in_place {
        let left = op.deadline.saturating_duration_since(Instant::now());
        peers.io_timeout().min(left.max(Duration::from_millis(1)))
    } else {
        peers.io_timeout()
    };
    let c = Chunk {
        peers,
        link,
        op,
        open: idxs,
        flights: HashMap::new(),
        ahead: None,
        sent: None,
        in_place,
        io,
    };
    let (c, r) = c.run().await;
    let Chunk {
        peers, link, op, ..
    } = &c;
    let lat = peers.metrics().now_ns().saturating_sub(t0);
    let status = if r.is_ok() {
        kvnode_proto::obs::OpStatus::Ok
    } else {
        kvnode_proto::obs::OpStatus::Error
    };
    crate::probes::peer_pull_done(peer_idx, op.id, n as u32, 0, status, lat);
    if r.is_ok() {
        peers.metrics().record_peer(&link.name, lat, 0);
    }
    if let Err(e) = r {
        let why = e.failure();
        tracing::debug!(peer = %link.name, op = op.id, error = %why, "pull chunk failed");
        for &i in &c.open {
            op.set(i, KeyOutcome::Failed(why.clone()));
        }
        peers.count_failure();
    }
}

/// Keys counted in a link's `outstanding` until dropped.
struct InFlight(Arc<PeerLink>, u64);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(self.1, Ordering::Relaxed);
    }
}

impl Chunk {
    /// Takes a connection permit and a connection, pulls, and hands the chunk back.
    async fn run(self) -> (Self, Result<(), PeerError>) {
        let p = &self.peers;
        let permit = tokio::time::timeout(
            p.connect_timeout(),
            Arc::clone(&self.link.permits).acquire_owned(),
        )
        .await;
        let Ok(permit) = permit else {
            let busy = PeerError::from(PullError::Busy {
                peer: self.link.endpoint.clone(),
            });
            return (self, Err(busy));
        };
        let permit = permit.expect("semaphore never closed");
        let pooled = loop {
            let w = self.link.idle.lock().expect("idle lock").pop();
            match w {
                // A session under a key no longer held is dropped, not reused.
                Some(w) if !self.peers.key_held(w.key_id()) => drop(w),
                w => break w,
            }
        };
        let (mut w, mut was_pooled) = match pooled {
            Some(w) => (w, true),
            None => match self.link.dial(&self.peers).await {
                Ok(w) => (w, false),
                Err(e) => return (self, Err(e)),
            },
        };
        let mut c = self;
        if let Err(e) = c.send_early(&mut w) {
            if !(was_pooled && stale(&e)) {
                return (c, Err(e));
            }
            // Nothing was answered on it: a fresh connection, requests sent by the thread.
            (w, was_pooled) = match c.link.dial(&c.peers).await {
                Ok(w) => (w, false),
                Err(e) => return (c, Err(e)),
            };
        }
        let before = c.open.len();
        let (c, w, r) = c.pull_blocking(w).await;
        let (c, w, r) = match r {
            Err(e) if was_pooled && c.open.len() == before && stale(&e) => {
                tracing::debug!(peer = %c.link.name, error = %e, "pooled connection went stale; redialling");
                match c.link.dial(&c.peers).await {
                    Ok(w) => c.pull_blocking(w).await,
                    Err(e) => return (c, Err(e)),
                }
            }
            r => (c, w, r),
        };
        if r.is_ok() {
            c.link.checkin(w);
        }
        drop(permit);
        (c, r)
    }

    /// Runs [`Chunk::pull_on`] on a blocking-pool thread that owns `w` until it returns.
    ///
    /// In place instead (a small pull its client's request awaits, on a multi-threaded
    /// runtime): on this worker thread, which the runtime replaces for its other tasks
    /// (`block_in_place`). The thread that reads the answer then also replies to the client,
    /// a wake-up fewer on the request's path (`kvnode bench pull`'s 64 KiB p50, docs/
    /// benchmarks.md). Its waits are bounded by the op's deadline as well as the io timeout;
    /// a deadline that passes mid-pull abandons it (the connection is closed), where a
    /// pull on a pool thread would go on landing into the DRAM tier.
    async fn pull_blocking(mut self, mut w: PullWire) -> (Self, PullWire, Result<(), PeerError>) {
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if self.in_place && multi {
            let r = tokio::task::block_in_place(|| self.pull_on(&mut w));
            let r = match r {
                Err(e) if e.timed_out().is_some() && Instant::now() >= self.op.deadline => {
                    Err(PullError::Deadline.into())
                }
                r => r,
            };
            return (self, w, r);
        }
        let t = tokio::task::spawn_blocking(move || {
            let r = self.pull_on(&mut w);
            (self, w, r)
        });
        match t.await {
            Ok(done) => done,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Pulls the open keys over `w`; on failure, every GET still in flight is landed
    /// (if already finished) or cancelled before its slot is freed.
    fn pull_on(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let r = self.pull_frames(w);
        if self.flights.is_empty() {
            return r;
        }
        let r = r.and(Err(Violation::GetsOutlivedRequests.into()));
        self.abandon_gets(w)?;
        r
    }

    /// The op's namespace id on the wire.
    fn wire_ns(&self) -> Result<NamespaceId, PeerError> {
        self.peers
            .store()
            .namespace_id(self.op.ns)
            .map_err(|e| PullError::Namespace(e).into())
    }

    /// One `Pull` per `batch_keys` open keys, with fresh request ids.
    fn requests(&self, ns: NamespaceId) -> (Vec<PeerMsg>, Requests) {
        let mut reqs = Requests::new();
        let mut msgs = Vec::new();
        for part in self.open.chunks(self.peers.batch_keys()) {
            let req = self.link.next_req.fetch_add(1, Ordering::Relaxed);
            let keys = part
                .iter()
                .map(|&i| PullKey(self.op.keys[i].0, self.op.keys[i].1))
                .collect();
            msgs.push(PeerMsg::Pull { req, ns, keys });
            reqs.insert(req, part.to_vec());
        }
        (msgs, reqs)
    }

    /// Sends the chunk's requests from the runtime task, without waiting on the socket, so
    /// the source starts answering while the receiving thread is still being woken.
    fn send_early(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let (msgs, reqs) = self.requests(self.wire_ns()?);
        let t = Instant::now();
        w.send_early(&msgs)?;
        self.sent = Some((reqs, t));
        Ok(())
    }

    fn pull_frames(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let io = self.io;
        let ns = self.wire_ns()?;
        let (mut reqs, sent) = if let Some(early) = self.sent.take() {
            early
        } else {
            let (msgs, reqs) = self.requests(ns);
            let t = Instant::now();
            w.send_all(&msgs, io)?;
            (reqs, t)
        };
        let mut timing = Timing::since(sent);
        while !reqs.is_empty() {
            if self.in_place && Instant::now() >= self.op.deadline {
                return Err(PullError::Deadline.into());
            }
            let (msg, _) = w.recv(io)?;
            if let Some(len) = self.on_frame(w, ns, &mut reqs, msg)? {
                timing.block(len);
            }
        }
        timing.record(&self.peers, &self.link.name);
        Ok(())
    }

    /// Acts on one frame from the source: the length of the block it brought (received, or
    /// its GET started), if any.
    fn on_frame(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        reqs: &mut Requests,
        msg: PeerMsg,
    ) -> Result<Option<u32>, PeerError> {
        let at = |reqs: &Requests, req: u64, idx: u32| {
            reqs.get(&req)
                .and_then(|v| v.get(idx as usize))
                .copied()
                .ok_or(Violation::UnknownKey { req, idx })
        };
        match msg {
            PeerMsg::Block {
                req,
                idx,
                len,
                hash,
                seal,
            } => {
                let i = at(reqs, req, idx)?;
                let body = Body::Inline(&seal);
                let a = Answer { i, req, len, body };
                self.block(w, ns, a, &hash).map(Some)
            }
            PeerMsg::Slot {
                req,
                idx,
                len,
                addr,
                hash,
                seal,
            } => {
                let i = at(reqs, req, idx)?;
                let body = Body::Remote(addr, &seal);
                let a = Answer { i, req, len, body };
                self.block(w, ns, a, &hash).map(Some)
            }
            PeerMsg::UcxOffer {
                worker,
                rkey,
                base,
                len,
            } => {
                // The old endpoint closes: what it is reading lands first.
                self.land_where(w, ns, |_| true)?;
                let slots = w.slots().ok_or(Violation::OfferWithoutUcx)?;
                slots.rekey(&worker, &rkey, base, len).map(|()| None)
            }
            PeerMsg::Miss { req, idx } => {
                let i = at(reqs, req, idx)?;
                self.answered(i)?;
                self.op.set(i, KeyOutcome::Missed);
                Ok(None)
            }
            PeerMsg::Done { req } => self.done(w, ns, reqs, req).map(|()| None),
            PeerMsg::Pong { .. } => Ok(None),
            PeerMsg::Refused { reason } => Err(HandshakeError::Refused(Verbatim(reason)).into()),
            other => Err(Violation::FromSource {
                got: Box::new(other),
            }
            .into()),
        }
    }

    /// Request `req` is answered: its GETs land (every `Slot` of it came before its `Done`),
    /// then, on a connection that reads slots, the source may release its leases.
    fn done(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        reqs: &mut Requests,
        req: u64,
    ) -> Result<(), PeerError> {
        self.land_where(w, ns, |f| f.req == req)?;
        let keys = reqs.remove(&req).ok_or(Violation::UnknownRequest { req })?;
        if keys.iter().any(|i| self.open.contains(i)) {
            return Err(Violation::Unanswered { req }.into());
        }
        if w.slots().is_some() {
            w.send_all(&[PeerMsg::Landed { req }], self.io)?;
        }
        Ok(())
    }

    /// Receives key `a.i`'s block (a `Block` body, or a `Slot` whose GET is started and
    /// lands later) whose header claims `hash`; returns its length.
    fn block(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        a: Answer<'_>,
        hash: &[u8],
    ) -> Result<u32, PeerError> {
        // Stays open until received (landed), so a failure before fails this key too.
        let i = a.i;
        self.position(i)?;
        if self.flights.contains_key(&i) {
            return Err(Violation::AnsweredTwice { key: i }.into());
        }
        let hash: [u8; HASH_LEN] = hash
            .try_into()
            .map_err(|_| Violation::HashLength { len: hash.len() })?;
        if self.receive(w, ns, a, hash)? {
            self.answered(i)?;
        }
        Ok(a.len)
    }

    fn position(&self, i: usize) -> Result<usize, PeerError> {
        self.open
            .iter()
            .position(|&x| x == i)
            .ok_or(Violation::AnsweredTwice { key: i }.into())
    }

    fn answered(&mut self, i: usize) -> Result<(), PeerError> {
        let pos = self.position(i)?;
        self.open.swap_remove(pos);
        Ok(())
    }

    /// Reads one block's payload off the wire into a reserved DRAM slot, verifies it against
    /// `hash` and commits it; or starts the GET of the source's slot into one. Whether the key
    /// is settled (false: its GET is in flight).
    fn receive(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        a: Answer<'_>,
        hash: [u8; HASH_LEN],
    ) -> Result<bool, PeerError> {
        let Answer { i, req, len, body } = a;
        let p = &self.peers;
        let io = self.io;
        let key = self.op.keys[i];
        let reserved =
            p.store()
                .reserve(p.reservation_owner(), self.op.ns, &[key], &[u64::from(len)]);
        let mut landing = match reserved {
            Ok(mut v) => match v.pop() {
                Some(Ok(r)) => Landing::slot(r),
                Some(Err(st)) => Landing::scratch(len, Some(st)),
                None => Landing::scratch(len, None),
            },
            Err(e) => {
                // Read the payload off the wire anyway, so the connection stays in step
                // (a Slot leaves nothing on the wire).
                if let Body::Inline(seal) = body {
                    let mut scratch = vec![0; len as usize];
                    read_hashed(w, &mut scratch, seal, io, None)?;
                }
                let why = Failure::new(FailCode::LocalStore, e.to_string());
                self.op.set(i, KeyOutcome::Failed(why));
                return Ok(true);
            }
        };
        match body {
            Body::Inline(seal) => {
                // On error `landing` drops here: the reservation is freed unpublished.
                let ahead = self.hash_ahead(len);
                let checked = read_checked(w, landing.dst(), seal, io, ahead)?;
                self.settle(ns, i, len, &hash, landing, checked);
                Ok(true)
            }
            Body::Remote(addr, seal) => {
                let f = Flight {
                    req,
                    len,
                    hash,
                    tag: seal.try_into().ok(),
                    landing,
                };
                self.post_get(w, ns, i, addr, f)?;
                Ok(false)
            }
        }
    }

    /// The hashing helper for a block of `len` bytes: started at the chunk's first block
    /// long enough to use it; `None` (hash in this thread) for short blocks or when no
    /// thread could be started.
    fn hash_ahead(&mut self, len: u32) -> Option<&HashAhead> {
        if (len as usize) < hash_ahead::MIN_BLOCK {
            return None;
        }
        if self.ahead.is_none() {
            match HashAhead::spawn() {
                Ok(h) => self.ahead = Some(h),
                Err(e) => {
                    tracing::debug!(error = %e, "no hashing thread for this pull; hashing inline");
                    return None;
                }
            }
        }
        self.ahead.as_ref()
    }

    /// Commits landed bytes to the store and the op if `checked` says they are the block
    /// whose hash is `hash`; a mismatch fails the key and commits nothing.
    fn settle(
        &self,
        ns: NamespaceId,
        i: usize,
        len: u32,
        hash: &[u8; HASH_LEN],
        mut landing: Landing,
        checked: Checked,
    ) {
        let p = &self.peers;
        let key = self.op.keys[i];
        let (ok, by, tag) = match checked {
            // blake3::Hash compares in constant time.
            Checked::Hashed(sum) => (
                blake3::Hash::from(sum) == blake3::Hash::from(*hash),
                "BLAKE3",
                None,
            ),
            // The tag came in the sealed header with `hash`, computed by the source from the
            // same bytes: matching bytes are the bytes `hash` names.
            Checked::Tagged { ok, id, tag } => (ok, "block MAC", Some((id, tag))),
        };
        if !ok {
            p.count_failure();
            let why = Failure::new(
                FailCode::Checksum,
                format!(
                    "checksum mismatch ({by}) on a {len}-byte block from {}: altered in transit, or changed on the source; not committed",
                    self.link.name
                ),
            );
            tracing::warn!(op = self.op.id, "{}", why.message);
            self.op.set(i, KeyOutcome::Failed(why));
            return;
        }
        let copied = self.op.copy_into(i, landing.dst());
        let mut lease = None;
        let outcome = match (landing.slot, landing.refused) {
            (Some(r), _) => {
                let at = SlotId {
                    ns,
                    digest: key.0,
                    segment: key.1,
                    offset: r.offset(),
                    len: u64::from(len),
                    fingerprint: fingerprint(hash),
                };
                // An op whose consumer copies the block onward keeps the commit's lease for
                // it (no second lookup, no eviction before the copy).
                let committed = if self.op.hands_leases() {
                    lease = r.commit_verified_leased(at.fingerprint);
                    lease.is_some()
                } else {
                    r.commit_verified(at.fingerprint) == CommitStatus::Committed
                };
                if committed {
                    p.hashes.put(at, Sums { hash: *hash, tag });
                    p.count_pulled(u64::from(len));
                }
                KeyOutcome::Pulled
            }
            (None, Some(PutStatus::Exists)) => KeyOutcome::Pulled,
            (None, st) if copied == Ok(true) => {
                tracing::debug!(status = ?st, "pulled block copied to the client only");
                KeyOutcome::Pulled
            }
            (None, st) => KeyOutcome::Failed(Failure::new(
                FailCode::LocalStore,
                format!("cannot store the pulled block: {st:?}"),
            )),
        };
        match copied {
            Err(why) => self.op.set(i, KeyOutcome::Failed(why)),
            Ok(_) => self.op.set_leased(i, outcome, lease),
        }
    }
}
