//! The destination's pull of one chunk as a protocol state machine with no I/O and no clock
//! (quinn-proto's model): frames and time go in, steps come out. It names no transport and
//! reads no clock; its driver ([`super::Chunk`], with `gets.rs` for one-sided reads) owns the
//! connection, the store and the op, and feeds it.
//!
//! ```text
//!   driver (fetch.rs, fetch/gets.rs)                 PullMachine (this file)
//!   requests(ns, keys, batch) ──────────────────────> records each Pull's keys; the frames to send
//!   PullConn::recv ─> frame ──── handle_frame ──────> Step: Body | Outcome | Done | Nothing
//!   Body: read (or GET) and check the bytes ─ body_in ─> Verdict: Commit | Mismatch (key answered)
//!   Body by GET: get_started ... get_landed ────────> the GET's landing back, then body_in
//!   Done: its GETs landed ──────── close ───────────> the request checked and closed
//!   Instant::now() ─ handle_timeout / on_error ─────> the deadline (in-place pulls)
//! ```
//!
//! The rules it keeps (docs/peer-protocol.md, "Pulls"):
//! - an answer (`Block`, `Slot`, `Miss`) names a request sent and not yet done and an index
//!   inside it (else [`Violation::UnknownKey`]: also an answer after its request's `Done`);
//!   its key is still open and has no GET in flight (else [`Violation::AnsweredTwice`]); a
//!   block's hash is [`HASH_LEN`] bytes (else [`Violation::HashLength`]). The source answers
//!   in request order; the destination accepts an open key's answer in any order.
//! - `Done` names a request not yet done ([`Violation::UnknownRequest`]) whose every key was
//!   answered ([`Violation::Unanswered`]); the driver lands the request's GETs first.
//! - `Refused` ends the pull with the source's reason; `Pong` is ignored; anything else is
//!   [`Violation::FromSource`].
//! - a bad block fails its key alone ([`Verdict::Mismatch`]); the frame stream is in step.
//! - with a deadline (a pull received in place), once [`PullMachine::handle_timeout`] saw it
//!   pass, every later frame and body is refused with [`PullError::Deadline`]: nothing after
//!   it is committed, and the open keys fail with the deadline's code.
//!
//! The op fence (peer/op.rs) is the op's: the driver copies a verified block into the
//! client's buffer and sets its outcome only through `PullOp`, which ignores both once the
//! op has ended. Unit tests (`machine/tests.rs`) drive the machine and a real `PullOp` step by
//! step in memory, with no socket, no sleep and no clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvnode_blockmac::TAG_LEN;
use kvnode_proto::peer::{HASH_LEN, PeerMeta, PeerMsg, PullKey};
use kvnode_proto::pull::{FailCode, Failure, KeyOutcome};
use kvnode_proto::{Key, NamespaceId};

use crate::peer::PeerError;
use crate::peer::error::{HandshakeError, PullError, Verbatim, Violation};

#[cfg(test)]
mod tests;

/// Where a block's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Body {
    /// The payload that follows the `Block` frame, with its AEAD tag (`seal`, empty unless
    /// encrypted) or block MAC.
    Inline { seal: Vec<u8> },
    /// A one-sided read (GET) of the source's memory at `addr`, with the block MAC its `Slot`
    /// carried (empty when none).
    Remote { addr: u64, seal: Vec<u8> },
}

/// A block answer: op key `i` of request `req`, `len` bytes whose sealed header claims
/// `hash`, and where they come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    pub(super) i: usize,
    pub(super) req: u64,
    pub(super) len: u32,
    pub(super) hash: [u8; HASH_LEN],
    pub(super) body: Body,
    /// The source's router metadata of the block, when asked for and sent.
    pub(super) meta: Option<PeerMeta>,
}

/// What the driver does next for one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Nothing (a `Pong`).
    Nothing,
    /// Receive and check key `i`'s bytes, then [`PullMachine::body_in`]; or start their GET
    /// ([`PullMachine::get_started`]).
    Body(Answer),
    /// Key `key` is answered with `outcome` (a `Miss`): record it.
    Outcome { key: usize, outcome: KeyOutcome },
    /// The source finished request `req`: land its GETs, then [`PullMachine::close`].
    Done(u64),
}

/// How received bytes were checked.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Checked {
    /// By their BLAKE3 hash, to compare with the header's.
    Hashed([u8; HASH_LEN]),
    /// Against the block MAC in their header under cluster key `id`: whether it matched.
    Tagged {
        ok: bool,
        id: u64,
        tag: [u8; TAG_LEN],
    },
}

/// What a key's checked bytes become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// They are the block the header named: commit them (`tag`: the block MAC computed and
    /// its key id, kept for serving the block on).
    Commit { tag: Option<(u64, [u8; TAG_LEN])> },
    /// They are not: fail the key ([`Check::failure`]) and commit nothing.
    Mismatch(Check),
}

/// Which check refused a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Check {
    /// Its BLAKE3 hash differs from the header's.
    Blake3,
    /// Its block MAC differs from the header's.
    BlockMac,
}

impl Check {
    /// The failure of a `len`-byte block from `peer` that this check refused.
    pub(super) fn failure(self, len: u32, peer: &str) -> Failure {
        let by = match self {
            Self::Blake3 => "BLAKE3",
            Self::BlockMac => "block MAC",
        };
        Failure::new(
            FailCode::Checksum,
            format!(
                "checksum mismatch ({by}) on a {len}-byte block from {peer}: altered in transit, or changed on the source; not committed"
            ),
        )
    }
}

/// A GET in flight: the request it answers and what the driver keeps with it (`G`: its
/// landing, until the transport reports it).
#[derive(Debug)]
struct Flying<G> {
    req: u64,
    get: G,
}

/// The pull state of one chunk of an op's keys on one connection.
#[derive(Debug)]
pub(super) struct PullMachine<G> {
    /// Keys of this chunk not yet answered (op key indices); a key whose GET is in flight
    /// stays here until it lands.
    open: Vec<usize>,
    /// Keys (op key indices) of each `Pull` request sent and not yet done, by request id.
    reqs: HashMap<u64, Vec<usize>>,
    /// Keys whose GET is in flight.
    flights: HashMap<usize, Flying<G>>,
    /// A pull received in place: the op's deadline.
    deadline: Option<Instant>,
    /// [`PullMachine::handle_timeout`] saw the deadline pass.
    expired: bool,
    /// Ask the source for each block's router metadata (this node announces KV events).
    meta: bool,
}

impl<G> PullMachine<G> {
    /// A chunk pulling op keys `open`, abandoned at `deadline` if it has one.
    pub(super) fn new(open: Vec<usize>, deadline: Option<Instant>) -> Self {
        Self {
            open,
            reqs: HashMap::new(),
            flights: HashMap::new(),
            deadline,
            expired: false,
            meta: false,
        }
    }

    /// Its `Pull`s ask for each block's router metadata (`on`: this node announces what it
    /// pulls).
    pub(super) fn asking_meta(mut self, on: bool) -> Self {
        self.meta = on;
        self
    }

    /// The longest wait without progress at `now`: `io`, and with a deadline no longer than
    /// what is left of it (at least 1 ms).
    pub(super) fn wait_limit(&self, now: Instant, io: Duration) -> Duration {
        match self.deadline {
            Some(d) => io.min(
                d.saturating_duration_since(now)
                    .max(Duration::from_millis(1)),
            ),
            None => io,
        }
    }

    /// Keys not yet answered.
    pub(super) fn open(&self) -> &[usize] {
        &self.open
    }

    /// Whether every request sent is done.
    pub(super) fn is_done(&self) -> bool {
        self.reqs.is_empty()
    }

    /// One `Pull` per `batch` open keys (`keys`: the op's), with request ids from `next_req`;
    /// they replace any sent before (on a fresh connection).
    pub(super) fn requests(
        &mut self,
        ns: NamespaceId,
        keys: &[Key],
        batch: usize,
        mut next_req: impl FnMut() -> u64,
    ) -> Vec<PeerMsg> {
        self.reqs.clear();
        let mut msgs = Vec::new();
        for part in self.open.chunks(batch) {
            let req = next_req();
            let wire = part
                .iter()
                .map(|&i| PullKey(keys[i].0, keys[i].1))
                .collect();
            msgs.push(PeerMsg::Pull {
                req,
                ns,
                keys: wire,
                meta: self.meta,
            });
            self.reqs.insert(req, part.to_vec());
        }
        msgs
    }

    /// Time passed: `now` at or past the deadline abandons the pull.
    pub(super) fn handle_timeout(&mut self, now: Instant) -> Result<(), PullError> {
        if self.deadline.is_some_and(|d| now >= d) {
            self.expired = true;
        }
        self.alive()
    }

    /// `e` as the pull's error at `now`: a wait that timed out past the deadline is the
    /// deadline.
    pub(super) fn on_error(&mut self, now: Instant, e: PeerError) -> PeerError {
        if e.timed_out().is_some() && self.handle_timeout(now).is_err() {
            return PullError::Deadline.into();
        }
        e
    }

    fn alive(&self) -> Result<(), PullError> {
        if self.expired {
            return Err(PullError::Deadline);
        }
        Ok(())
    }

    /// Takes one frame from the source.
    pub(super) fn handle_frame(&mut self, msg: PeerMsg) -> Result<Step, PeerError> {
        self.alive()?;
        match msg {
            PeerMsg::Block {
                req,
                idx,
                len,
                hash,
                seal,
                meta,
            } => self.answer((req, idx, len), &hash, Body::Inline { seal }, meta),
            PeerMsg::Slot {
                req,
                idx,
                len,
                addr,
                hash,
                seal,
                meta,
            } => self.answer((req, idx, len), &hash, Body::Remote { addr, seal }, meta),
            PeerMsg::Miss { req, idx } => {
                let key = self.at(req, idx)?;
                self.answered(key)?;
                Ok(Step::Outcome {
                    key,
                    outcome: KeyOutcome::Missed,
                })
            }
            PeerMsg::Done { req } => Ok(Step::Done(req)),
            PeerMsg::Pong { .. } => Ok(Step::Nothing),
            PeerMsg::Refused { reason } => Err(HandshakeError::Refused(Verbatim(reason)).into()),
            other => Err(Violation::FromSource {
                got: Box::new(other),
            }
            .into()),
        }
    }

    /// The op key that request `req`'s key `idx` names.
    fn at(&self, req: u64, idx: u32) -> Result<usize, Violation> {
        self.reqs
            .get(&req)
            .and_then(|v| v.get(idx as usize))
            .copied()
            .ok_or(Violation::UnknownKey { req, idx })
    }

    fn answer(
        &self,
        (req, idx, len): (u64, u32, u32),
        hash: &[u8],
        body: Body,
        meta: Option<PeerMeta>,
    ) -> Result<Step, PeerError> {
        let i = self.at(req, idx)?;
        // Stays open until received (landed), so a failure before fails this key too.
        self.position(i)?;
        if self.flights.contains_key(&i) {
            return Err(Violation::AnsweredTwice { key: i }.into());
        }
        let hash = hash
            .try_into()
            .map_err(|_| Violation::HashLength { len: hash.len() })?;
        Ok(Step::Body(Answer {
            i,
            req,
            len,
            hash,
            body,
            meta,
        }))
    }

    fn position(&self, i: usize) -> Result<usize, Violation> {
        self.open
            .iter()
            .position(|&x| x == i)
            .ok_or(Violation::AnsweredTwice { key: i })
    }

    /// Key `i` is answered without its bytes being checked (the store refused a slot: the
    /// driver fails it).
    pub(super) fn answered(&mut self, i: usize) -> Result<(), PeerError> {
        let pos = self.position(i)?;
        self.open.swap_remove(pos);
        Ok(())
    }

    /// Key `i`'s bytes are in and were checked as `checked` against the header's `hash`:
    /// the key is answered, and the verdict says whether to commit them.
    pub(super) fn body_in(
        &mut self,
        i: usize,
        hash: &[u8; HASH_LEN],
        checked: Checked,
    ) -> Result<Verdict, PeerError> {
        self.alive()?;
        self.answered(i)?;
        Ok(match checked {
            // blake3::Hash compares in constant time.
            Checked::Hashed(sum) if blake3::Hash::from(sum) == blake3::Hash::from(*hash) => {
                Verdict::Commit { tag: None }
            }
            Checked::Hashed(_) => Verdict::Mismatch(Check::Blake3),
            // The tag came in the sealed header with `hash`, computed by the source from the
            // same bytes: matching bytes are the bytes `hash` names.
            Checked::Tagged { ok: true, id, tag } => Verdict::Commit {
                tag: Some((id, tag)),
            },
            Checked::Tagged { ok: false, .. } => Verdict::Mismatch(Check::BlockMac),
        })
    }

    /// Key `i`'s GET (answering request `req`) was started; `get` is kept until it lands.
    pub(super) fn get_started(&mut self, i: usize, req: u64, get: G) {
        self.flights.insert(i, Flying { req, get });
    }

    /// The transport reported key `i`'s GET: what was kept with it. The key stays open
    /// until [`PullMachine::body_in`].
    pub(super) fn get_landed(&mut self, i: usize) -> Result<G, Violation> {
        self.flights
            .remove(&i)
            .map(|f| f.get)
            .ok_or(Violation::GetNotInFlight { key: i })
    }

    /// Whether a GET is in flight for request `req` (any request: `None`).
    pub(super) fn gets_for(&self, req: Option<u64>) -> bool {
        self.flights
            .values()
            .any(|f| req.is_none_or(|r| f.req == r))
    }

    /// Every GET in flight, handed back to be cancelled (their keys stay open).
    pub(super) fn drain_gets(&mut self) -> impl Iterator<Item = (usize, G)> + '_ {
        self.flights.drain().map(|(i, f)| (i, f.get))
    }

    /// Request `req` is done (its GETs landed): every key of it must have been answered.
    pub(super) fn close(&mut self, req: u64) -> Result<(), PeerError> {
        let keys = self
            .reqs
            .remove(&req)
            .ok_or(Violation::UnknownRequest { req })?;
        if keys.iter().any(|i| self.open.contains(i)) {
            return Err(Violation::Unanswered { req }.into());
        }
        Ok(())
    }
}
