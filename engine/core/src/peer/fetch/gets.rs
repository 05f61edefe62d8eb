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
use std::time::Duration;

use super::machine::Checked;
use super::{Arrived, Chunk, PeerError, PullWire};
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

/// A block whose GET is in flight (kept by the chunk's machine until it lands).
pub(super) struct Flight {
    /// The block MAC its sealed `Slot` carried, if any.
    pub(super) tag: Option<[u8; TAG_LEN]>,
    /// The key, its length and hash, and the slot the GET writes.
    pub(super) arrived: Arrived,
}

impl Chunk {
    /// Starts key `f`'s GET (answering request `req`) from the source's `addr` into its
    /// landing, after landing older GETs while the window is full.
    pub(super) fn post_get(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        req: u64,
        addr: u64,
        mut f: Flight,
    ) -> Result<(), PeerError> {
        while slots(w)?.in_flight() >= slots(w)?.window() {
            self.land_one(w, ns)?;
        }
        let i = f.arrived.i;
        let dst = f.arrived.landing.dst();
        // SAFETY: the landing moves into the machine's flights (its bytes stay put) and
        // leaves only when the GET has landed, or was handed back by `abandon`, or is
        // retired if UCX keeps it.
        unsafe { slots(w)?.post(dst.as_mut_ptr(), dst.len(), addr, i as u64) }?;
        self.m.get_started(i, req, f);
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
        let mut f = self.m.get_landed(i)?;
        r?; // the buffer is quiet: dropping `f` frees its slot
        self.link
            .ucx_gets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // One fast pass against the Slot's block MAC where the session has one, else BLAKE3.
        let dst = f.arrived.landing.dst();
        let checked = match (mac, f.tag) {
            (Some(m), Some(want)) => {
                let got = m.tag(dst);
                Checked::Tagged {
                    ok: tags_equal(&got, &want),
                    id: m.id(),
                    tag: got,
                }
            }
            _ => Checked::Hashed(*blake3::hash(dst).as_bytes()),
        };
        let verdict = self.m.body_in(i, &f.arrived.hash, checked)?;
        self.settle(ns, f.arrived, verdict);
        Ok(())
    }

    /// Lands every GET in flight for request `req` (every request: `None`).
    pub(super) fn land_where(
        &mut self,
        w: &mut PullWire,
        ns: NamespaceId,
        req: Option<u64>,
    ) -> Result<(), PeerError> {
        while self.m.gets_for(req) {
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
        for (i, f) in self.m.drain_gets() {
            if kept.contains(&(i as u64)) {
                f.arrived.landing.retire();
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
