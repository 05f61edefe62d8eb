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
//!
//! The pull's protocol state (which keys each request asked for, which are answered, the
//! GETs in flight, the deadline) and its rules live in [`machine::PullMachine`], which has
//! no socket and no clock; [`Chunk`] drives it: it reads frames and bodies through the
//! [`PullConn`](super::transport::PullConn) contract, feeds them and the time to the
//! machine, and carries out its steps against the transport, the store and the op.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvnode_proto::NamespaceId;
use kvnode_proto::client::{CommitStatus, PutStatus};
use kvnode_proto::peer::{HASH_LEN, PeerMsg};
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome};

use super::error::{PullError, Violation};
use super::hashes::{SlotId, Sums, fingerprint};
use super::op::PullOp;
use super::transport::{PullConn as _, PullWire, SlotReads as _};
use super::{PeerError, Peers};
use crate::store::Lease;

mod check;
mod gets;
mod hash_ahead;
mod link;
mod machine;

use check::{read_checked, read_hashed};
use gets::{Flight, Landing};
use hash_ahead::HashAhead;
pub use link::PeerLink;
use link::stale;
use machine::{Answer, Body, PullMachine, Step, Verdict};

/// When a pull's blocks came, from its requests' send: the first, the last, and how many
/// (`stats`: first-block latency and the gap per further block).
/// One pull's measured cost, shared by its chunks: when the last chunk lets go, the pull's
/// bytes and time since it started go to the live cost model (`peer <name> x<stripes>`),
/// unless a chunk failed.
#[derive(Debug)]
pub struct PullCost {
    peers: Arc<Peers>,
    path: String,
    t0: Instant,
    bytes: AtomicU64,
    failed: AtomicBool,
}

impl PullCost {
    /// The cost of a pull from `peer` striped over `stripes` connections, starting now.
    pub fn new(peers: Arc<Peers>, peer: &str, stripes: usize) -> Arc<Self> {
        Arc::new(Self {
            peers,
            path: crate::obs::cost::peer_path(peer, stripes),
            t0: Instant::now(),
            bytes: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        })
    }
}

impl Drop for PullCost {
    fn drop(&mut self) {
        let bytes = *self.bytes.get_mut();
        if !*self.failed.get_mut() {
            self.peers
                .metrics()
                .costs
                .record(&self.path, bytes, self.t0.elapsed());
        }
    }
}

struct Timing {
    sent: Instant,
    first: Option<Duration>,
    last: Duration,
    blocks: u32,
    page: u64,
    bytes: u64,
}

impl Timing {
    fn since(sent: Instant) -> Self {
        Self {
            sent,
            first: None,
            last: sent.elapsed(),
            blocks: 0,
            page: 0,
            bytes: 0,
        }
    }

    /// A block of `len` bytes came now.
    fn block(&mut self, len: u32) {
        let now = self.sent.elapsed();
        self.first.get_or_insert(now);
        self.last = now;
        self.blocks += 1;
        self.page = u64::from(len);
        self.bytes += u64::from(len);
    }

    fn record(&self, p: &Peers, peer: &str) {
        if let Some(f) = self.first {
            let per = (self.blocks > 1).then(|| self.last.saturating_sub(f) / (self.blocks - 1));
            p.stats.record(peer, self.page, f, per);
        }
    }
}

/// The driver of one chunk's pull: it owns the connection's use, the store and the op, and
/// feeds frames and time to the chunk's [`PullMachine`], whose steps it carries out.
struct Chunk {
    peers: Arc<Peers>,
    link: Arc<PeerLink>,
    op: Arc<PullOp>,
    /// The pull's protocol state; each GET in flight keeps its [`Flight`] there.
    m: PullMachine<Flight>,
    /// The thread hashing large TCP blocks while they are received (started at the first).
    ahead: Option<HashAhead>,
    /// When the requests were sent from the runtime task ([`Chunk::send_early`]).
    sent: Option<Instant>,
    /// Received on the calling worker thread itself (see [`Chunk::pull_blocking`]).
    in_place: bool,
    /// Longest wait for the peer without progress: the io timeout, and for an in-place
    /// pull no longer than what was left of the op's deadline when it started.
    io: Duration,
    /// The whole pull's cost, shared with its other chunks.
    cost: Arc<PullCost>,
}

/// A pull awaited by its client's request with at most this many keys is received in place.
pub const IN_PLACE_KEYS: usize = 4;

/// Pulls op keys `idxs` from `link`, bounded by its connection permits and timeouts.
/// `in_place`: a small pull awaited by the client's own request, received on the calling
/// worker thread (see [`Chunk::pull_blocking`]).
pub async fn run_chunk(
    peers: Arc<Peers>,
    link: Arc<PeerLink>,
    op: Arc<PullOp>,
    idxs: Vec<usize>,
    in_place: bool,
    cost: Arc<PullCost>,
) {
    let n = idxs.len() as u64;
    // Releases the chunk's keys from the link's in-flight count however the pull ends
    // (also if its future is dropped unfinished).
    let _in_flight = InFlight(Arc::clone(&link), n);
    let peer_idx = (crate::probes::hash_name(&link.name) & 0xffff_ffff) as u32;
    crate::probes::peer_pull_start(peer_idx, op.id, n as u32);
    let t0 = peers.metrics().now_ns();
    let m = PullMachine::new(idxs, in_place.then_some(op.deadline))
        .asking_meta(peers.store().announces());
    let io = m.wait_limit(Instant::now(), peers.io_timeout());
    let c = Chunk {
        peers,
        link,
        op,
        m,
        ahead: None,
        sent: None,
        in_place,
        io,
        cost,
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
        c.cost.failed.store(true, Ordering::Relaxed);
        let why = e.failure();
        tracing::debug!(peer = %link.name, op = op.id, error = %why, "pull chunk failed");
        for &i in c.m.open() {
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

/// A key's checked bytes, where they landed, on their way to the store and the op.
struct Arrived {
    i: usize,
    len: u32,
    /// The hash its sealed header carried.
    hash: [u8; HASH_LEN],
    landing: Landing,
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
        let before = c.m.open().len();
        let (c, w, r) = c.pull_blocking(w).await;
        let (c, w, r) = match r {
            Err(e) if was_pooled && c.m.open().len() == before && stale(&e) => {
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
            let r = r.map_err(|e| self.m.on_error(Instant::now(), e));
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
        if !self.m.gets_for(None) {
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
    fn requests(&mut self, ns: NamespaceId) -> Vec<PeerMsg> {
        let link = &self.link;
        let next = || link.next_req.fetch_add(1, Ordering::Relaxed);
        self.m
            .requests(ns, &self.op.keys, self.peers.batch_keys(), next)
    }

    /// Sends the chunk's requests from the runtime task, without waiting on the socket, so
    /// the source starts answering while the receiving thread is still being woken.
    fn send_early(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let msgs = self.requests(self.wire_ns()?);
        let t = Instant::now();
        w.send_early(&msgs)?;
        self.sent = Some(t);
        Ok(())
    }

    /// Feeds the source's frames to the machine until every request is done.
    fn pull_frames(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let ns = self.wire_ns()?;
        let sent = if let Some(t) = self.sent.take() {
            t
        } else {
            let msgs = self.requests(ns);
            let t = Instant::now();
            w.send_all(&msgs, self.io)?;
            t
        };
        let mut timing = Timing::since(sent);
        while !self.m.is_done() {
            self.m.handle_timeout(Instant::now())?;
            let (msg, _) = w.recv(self.io)?;
            if let Some(len) = self.on_frame(w, ns, msg)? {
                timing.block(len);
            }
        }
        timing.record(&self.peers, &self.link.name);
        self.cost.bytes.fetch_add(timing.bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Acts on one frame from the source: the length of the block it brought (received, or
    /// its GET started), if any.
    fn on_frame(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        msg: PeerMsg,
    ) -> Result<Option<u32>, PeerError> {
        if let PeerMsg::UcxOffer {
            worker,
            rkey,
            base,
            len,
        } = msg
        {
            // The transport's own frame: the old endpoint closes, what it is reading lands
            // first.
            self.land_where(w, ns, None)?;
            let slots = w.slots().ok_or(Violation::OfferWithoutUcx)?;
            return slots.rekey(&worker, &rkey, base, len).map(|()| None);
        }
        match self.m.handle_frame(msg)? {
            Step::Nothing => Ok(None),
            Step::Body(a) => {
                let len = a.len;
                self.receive(w, ns, a)?;
                Ok(Some(len))
            }
            Step::Outcome { key, outcome } => {
                self.op.set(key, outcome);
                Ok(None)
            }
            Step::Done(req) => self.done(w, ns, req).map(|()| None),
        }
    }

    /// Request `req` is answered: its GETs land (every `Slot` of it came before its `Done`),
    /// then, on a connection that reads slots, the source may release its leases.
    fn done(&mut self, w: &mut PullWire, ns: NamespaceId, req: u64) -> Result<(), PeerError> {
        self.land_where(w, ns, Some(req))?;
        self.m.close(req)?;
        if w.slots().is_some() {
            w.send_all(&[PeerMsg::Landed { req }], self.io)?;
        }
        Ok(())
    }

    /// Reads key `a.i`'s block off the wire into a reserved DRAM slot, verifies it against
    /// its header's hash and commits it; or starts the GET of the source's slot into one
    /// (it lands later).
    fn receive(&mut self, w: &mut PullWire, ns: NamespaceId, a: Answer) -> Result<(), PeerError> {
        let Answer {
            i,
            req,
            len,
            hash,
            body,
            meta,
        } = a;
        let p = &self.peers;
        let io = self.io;
        let key = self.op.keys[i];
        let reserved =
            p.store()
                .reserve(p.reservation_owner(), self.op.ns, &[key], &[u64::from(len)]);
        let landing = match reserved {
            Ok(mut v) => match v.pop() {
                Some(Ok(mut r)) => {
                    // Announced with the source's metadata once committed (a block whose
                    // metadata does not fit its namespace or budget is stored unannounced).
                    r.set_meta(meta.and_then(|m| p.store().peer_meta(self.op.ns, &key, &m)));
                    Landing::slot(r)
                }
                Some(Err(st)) => Landing::scratch(len, Some(st)),
                None => Landing::scratch(len, None),
            },
            Err(e) => {
                // Read the payload off the wire anyway, so the connection stays in step
                // (a Slot leaves nothing on the wire).
                if let Body::Inline { seal } = &body {
                    let mut scratch = vec![0; len as usize];
                    read_hashed(w, &mut scratch, seal, io, None)?;
                }
                self.m.answered(i)?;
                let why = Failure::new(FailCode::LocalStore, e.to_string());
                self.op.set(i, KeyOutcome::Failed(why));
                return Ok(());
            }
        };
        let mut arrived = Arrived {
            i,
            len,
            hash,
            landing,
        };
        match body {
            Body::Inline { seal } => {
                // On error `arrived` drops here: the reservation is freed unpublished.
                let ahead = self.hash_ahead(len);
                let checked = read_checked(w, arrived.landing.dst(), &seal, io, ahead)?;
                let verdict = self.m.body_in(i, &hash, checked)?;
                self.settle(ns, arrived, verdict);
            }
            Body::Remote { addr, seal } => {
                let f = Flight {
                    tag: seal.as_slice().try_into().ok(),
                    arrived,
                };
                self.post_get(w, ns, req, addr, f)?;
            }
        }
        Ok(())
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

    /// Carries out the machine's verdict on checked bytes: a mismatch fails the key and
    /// commits nothing; matching bytes are copied to the client (under the op's fence),
    /// committed to the store, and the key's outcome recorded.
    fn settle(&self, ns: NamespaceId, mut a: Arrived, verdict: Verdict) {
        let tag = match verdict {
            Verdict::Commit { tag } => tag,
            Verdict::Mismatch(check) => {
                self.peers.count_failure();
                let why = check.failure(a.len, &self.link.name);
                tracing::warn!(op = self.op.id, "{}", why.message);
                self.op.set(a.i, KeyOutcome::Failed(why));
                return;
            }
        };
        let i = a.i;
        let copied = self.op.copy_into(i, a.landing.dst());
        let (outcome, lease) = self.commit(ns, a, tag, copied == Ok(true));
        match copied {
            Err(why) => self.op.set(i, KeyOutcome::Failed(why)),
            Ok(_) => self.op.set_leased(i, outcome, lease),
        }
    }

    /// Commits verified bytes to the store (with their hash and block MAC `tag`, kept for
    /// serving them on): the key's outcome, given whether they reached the client's buffer,
    /// and the commit's lease when the op hands leases to its consumer.
    fn commit(
        &self,
        ns: NamespaceId,
        a: Arrived,
        tag: Option<(u64, [u8; kvnode_blockmac::TAG_LEN])>,
        copied: bool,
    ) -> (KeyOutcome, Option<Lease>) {
        let p = &self.peers;
        let key = self.op.keys[a.i];
        let mut lease = None;
        let outcome = match (a.landing.slot, a.landing.refused) {
            (Some(r), _) => {
                let at = SlotId {
                    ns,
                    digest: key.0,
                    segment: key.1,
                    offset: r.offset(),
                    len: u64::from(a.len),
                    fingerprint: fingerprint(&a.hash),
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
                    p.hashes.put(at, Sums { hash: a.hash, tag });
                    p.count_pulled(u64::from(a.len));
                }
                KeyOutcome::Pulled
            }
            (None, Some(PutStatus::Exists)) => KeyOutcome::Pulled,
            (None, st) if copied => {
                tracing::debug!(status = ?st, "pulled block copied to the client only");
                KeyOutcome::Pulled
            }
            (None, st) => KeyOutcome::Failed(Failure::new(
                FailCode::LocalStore,
                format!("cannot store the pulled block: {st:?}"),
            )),
        };
        (outcome, lease)
    }
}
