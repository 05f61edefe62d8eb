//! The destination's window of UCX GETs on one connection: each `Slot` answer starts a
//! GET into a slot reserved for it, up to `[peer] ucx_gets_in_flight` at once; they land
//! in whatever order they finish, and each is checked (against the `Slot`'s block MAC in a
//! keyed plaintext session, else by BLAKE3) and committed as it lands.
//!
//! Guarantees kept from one GET at a time: a request's GETs have all landed before its
//! `Landed` is sent (the source holds its leases until then); every wait is bounded by the
//! I/O limit (a frozen source costs one limit, then the GETs are cancelled); on failure a
//! finished GET is still committed, every other one is cancelled and handed back before
//! its slot is freed, and a slot under a GET UCX never gives back is retired for good.

use kvnode_proto::NamespaceId;
use kvnode_proto::client::PutStatus;
use kvnode_proto::peer::HASH_LEN;
use std::time::Duration;

use super::{Checked, Chunk, PeerError, PullWire};
use crate::peer::transport::{PullConn, SlotReads as _};

use crate::peer::error::{PullError, Violation};
use crate::store::Reservation;
use kvnode_blockmac::{BlockMac, TAG_LEN, tags_equal};

/// Where a block's bytes land: its reserved DRAM slot, or scratch memory when the store
/// refused one (`refused`: why). Its bytes do not move when it moves.
pub(super) struct Landing {
    pub(super) slot: Option<Reservation>,
    pub(super) refused: Option<PutStatus>,
    scratch: Vec<u8>,
}

impl Landing {
    pub(super) fn slot(r: Reservation) -> Self {
        Self {
            slot: Some(r),
            refused: None,
            scratch: Vec::new(),
        }
    }

    pub(super) fn scratch(len: u32, refused: Option<PutStatus>) -> Self {
        Self {
            slot: None,
            refused,
            scratch: vec![0; len as usize],
        }
    }

    pub(super) fn dst(&mut self) -> &mut [u8] {
        match &mut self.slot {
            Some(r) => r.bytes_mut(),
            None => &mut self.scratch,
        }
    }

    /// Gives the memory up for good, freed never: a GET UCX kept may still write it.
    fn retire(self) {
        std::mem::forget(self.slot);
        std::mem::forget(self.scratch);
    }
}

/// A block whose GET is in flight.
pub(super) struct Flight {
    /// The `Pull` request it answers.
    pub(super) req: u64,
    pub(super) len: u32,
    /// The hash its sealed `Slot` carried.
    pub(super) hash: [u8; HASH_LEN],
    /// The block MAC its sealed `Slot` carried, if any.
    pub(super) tag: Option<[u8; TAG_LEN]>,
    pub(super) landing: Landing,
}

impl Chunk {
    /// Starts key `i`'s GET from the source's `addr` into `f`'s landing, after landing
    /// older GETs while the window is full.
    pub(super) fn post_get(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        i: usize,
        addr: u64,
        mut f: Flight,
    ) -> Result<(), PeerError> {
        while slots(w)?.in_flight() >= slots(w)?.window() {
            self.land_one(w, ns)?;
        }
        let dst = f.landing.dst();
        // SAFETY: the landing moves into `flights` (its bytes stay put) and leaves only when
        // the GET has landed, or was handed back by `abandon`, or is retired if UCX keeps it.
        unsafe { slots(w)?.post(dst.as_mut_ptr(), dst.len(), addr, i as u64) }?;
        self.flights.insert(i, f);
        Ok(())
    }

    /// Waits (at most the I/O limit) for one GET in flight to land, then checks and commits it.
    fn land_one(&mut self, w: &mut PullWire, ns: NamespaceId) -> Result<(), PeerError> {
        let io = self.io;
        let mac = w.block_mac();
        let (tag, r) = slots(w)?.land_one(io)?;
        self.landed(ns, tag, r, mac.as_deref())
    }

    /// Settles a GET UCX reported: a failed one leaves its key open (failed with the chunk).
    fn landed(
        &mut self,
        ns: NamespaceId,
        tag: u64,
        r: Result<(), PeerError>,
        mac: Option<&BlockMac>,
    ) -> Result<(), PeerError> {
        let i = tag as usize;
        let Some(mut f) = self.flights.remove(&i) else {
            return Err(Violation::GetNotInFlight { key: i }.into());
        };
        r?; // the buffer is quiet: dropping `f` frees its slot
        self.link
            .ucx_gets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // One fast pass against the Slot's block MAC where the session has one, else BLAKE3.
        let checked = match (mac, f.tag) {
            (Some(m), Some(want)) => {
                let got = m.tag(f.landing.dst());
                Checked::Tagged {
                    ok: tags_equal(&got, &want),
                    id: m.id(),
                    tag: got,
                }
            }
            _ => Checked::Hashed(*blake3::hash(f.landing.dst()).as_bytes()),
        };
        self.settle(ns, i, f.len, &f.hash, f.landing, checked);
        self.answered(i)
    }

    /// Lands every GET in flight that `which` selects.
    pub(super) fn land_where(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        which: impl Fn(&Flight) -> bool,
    ) -> Result<(), PeerError> {
        while self.flights.values().any(&which) {
            self.land_one(w, ns)?;
        }
        Ok(())
    }

    /// After a failure: commits the GETs that already finished, cancels the rest (closing
    /// the endpoint) and frees their slots once UCX hands them back, retiring any it keeps
    /// ([`PullError::Stuck`] then).
    pub(super) fn abandon_gets(&mut self, w: &mut PullWire) -> Result<(), PeerError> {
        let io = self.io;
        let mac = w.block_mac();
        let Some(u) = w.slots() else {
            return Err(Violation::GetsOnTcp.into());
        };
        let ns = self
            .peers
            .store()
            .namespace_id(self.op.ns)
            .map_err(PullError::Namespace)?;
        while let Ok((tag, r)) = u.land_one(Duration::ZERO) {
            // Late completions are kept; a failed one only drops its flight.
            let _ = self.landed(ns, tag, r, mac.as_deref());
        }
        let kept = u.abandon(io);
        for (i, f) in self.flights.drain() {
            if kept.contains(&(i as u64)) {
                f.landing.retire();
            }
        }
        if kept.is_empty() {
            return Ok(());
        }
        let e = PeerError::from(PullError::Stuck {
            gets: kept.len(),
            peer: self.link.endpoint.clone(),
        });
        tracing::error!(error = %e, "retiring the slots under uncancellable GETs");
        Err(e)
    }
}

/// The connection's one-sided reads: a `Slot` on a connection without them breaks the
/// protocol.
fn slots(w: &mut PullWire) -> Result<&mut <PullWire as PullConn>::Slots, PeerError> {
    w.slots().ok_or_else(|| Violation::SlotWithoutUcx.into())
}
