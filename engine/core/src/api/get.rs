//! `Get`, served in prefix order (store/get.rs):
//!
//! - **Inline** (`Delivery::Stream`): the reply header lists every block found (the
//!   prefix's plan); the payload then streams window by window (store/prefix.rs leases a
//!   window, promoting what is on NVMe; it is written to the socket and released), with the
//!   next window promoted while the current one is written. DRAM use stays bounded by two
//!   windows whatever the get's length. A get that fits one window is leased whole before
//!   the header.
//! - **Lease** (`Delivery::Hold`): the client holds the pages, so they must all fit now;
//!   when it stops short nothing is kept and the reply is `TooLarge` with the number of
//!   leading keys that can be leased. Every key named is charged to the uid's
//!   `leased_blocks_per_uid` first (the charge then shrinks to what was leased), so a get
//!   that would pass the cap is refused `LimitReached` before anything is leased.

use std::io::{self, IoSlice};
use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::{ErrorCode, GetMode, Reply};
use kvnode_proto::frame::MAX_PAYLOAD;
use kvnode_proto::pull::OpReport;

use super::errors::{error, invalid, tier_error, too_large};
use super::session::{HeldLease, Session};
use crate::store::{Delivery, Got, Lease};
use crate::tenant::Held;

/// The error that ends a streamed reply whose promised block is gone: the connection is
/// closed mid-payload, so the client sees a short frame and never a wrong byte.
fn vanished(key: usize) -> io::Error {
    io::Error::other(format!(
        "key {key} vanished after its length was sent (deleted, evicted from NVMe or failed its checksum): closing the connection mid-reply"
    ))
}

impl Session {
    pub(super) async fn get(
        &mut self,
        id: u64,
        ns: u32,
        keys: &[Key],
        mode: GetMode,
        pull: Option<Box<OpReport>>,
    ) -> io::Result<()> {
        match mode {
            GetMode::Lease => self.get_lease(id, ns, keys, pull).await,
            GetMode::Inline => self.get_inline(id, ns, keys, pull).await,
        }
    }

    async fn get_lease(
        &mut self,
        id: u64,
        ns: u32,
        keys: &[Key],
        pull: Option<Box<OpReport>>,
    ) -> io::Result<()> {
        let mut charge = match self.charge(Held::LeasedBlocks, keys.len() as u64) {
            Ok(c) => c,
            Err(over) => {
                let reply = error(ErrorCode::LimitReached, over.to_string());
                return self.send(id, reply, &[]).await;
            }
        };
        let store = Arc::clone(&self.engine.store);
        let got = match store.hold(ns, keys, false).await {
            Ok(l) => l,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        if let Some(n) = got.short {
            drop(got.leases);
            let reply = too_large(n, keys.len(), store.hold_limit());
            return self.send(id, reply, &[]).await;
        }
        let leased = got.leases;
        let extents = leased
            .iter()
            .map(|l| l.as_ref().map(Lease::extent))
            .collect();
        let held: Vec<Lease> = leased.into_iter().flatten().collect();
        charge.shrink(held.len() as u64);
        let lease = if held.is_empty() {
            0
        } else {
            let l = self.next_id();
            let now = self.engine.metrics.now_ns();
            self.watch.lease_begin(l, held.len() as u64, now);
            let held = HeldLease {
                blocks: held,
                _charge: charge,
            };
            self.leases.insert(l, held);
            l
        };
        let reply = Reply::GetLease {
            lease,
            extents,
            pull,
        };
        self.send(id, reply, &[]).await
    }

    async fn get_inline(
        &mut self,
        id: u64,
        ns: u32,
        keys: &[Key],
        pull: Option<Box<OpReport>>,
    ) -> io::Result<()> {
        let store = Arc::clone(&self.engine.store);
        let mut prefix = match store.prefix(ns, keys, Delivery::Stream) {
            Ok(p) => p,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        let total: u64 = prefix.plan().iter().map(|p| p.1).sum();
        if total > u64::from(MAX_PAYLOAD) {
            let msg = format!(
                "{total} bytes found exceed the 1 GiB frame limit: split the batch or use Lease mode"
            );
            return self.send(id, invalid(msg), &[]).await;
        }
        // The first window is leased before the header, so a get whose head cannot be had
        // answers cleanly; later windows are promised by the plan (streamed while the next
        // one is promoted).
        let first = match prefix.next().await {
            Ok(f) => f,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        let mut lens: Vec<Option<u64>> = if prefix.is_streamed() {
            prefix
                .plan()
                .iter()
                .map(|&(at, l)| at.is_local().then_some(l))
                .collect()
        } else {
            vec![None; keys.len()]
        };
        if let Some(w) = &first {
            for (i, g) in w.range().zip(&w.got) {
                lens[i] = match g {
                    Got::Leased(l) => Some(l.len()),
                    Got::Miss | Got::NoRoom => None,
                };
            }
            if let Some(end) = w.end() {
                // No room even for the first window (DRAM is full of other leases): the
                // answer is the prefix leased so far, nothing after it.
                lens[end..].iter_mut().for_each(|l| *l = None);
            }
        }
        let total: u64 = lens.iter().flatten().sum();
        self.send_head(
            id,
            Reply::GetInline {
                lens: lens.clone(),
                pull,
            },
            total,
        )
        .await?;
        let mut window = first;
        while let Some(w) = window {
            let mut slices = Vec::with_capacity(w.got.len());
            for (i, g) in w.range().zip(&w.got) {
                match (lens[i], g) {
                    (None, _) => {}
                    (Some(len), Got::Leased(b)) if b.len() == len => {
                        slices.push(IoSlice::new(b.bytes()));
                    }
                    (Some(_), _) => return Err(vanished(i)),
                }
            }
            let t0 = std::time::Instant::now();
            let bytes: u64 = slices.iter().map(|s| s.len() as u64).sum();
            self.io.write_all(&mut slices).await?;
            let costs = &self.engine.metrics.costs;
            costs.record(crate::obs::cost::DRAM_COPY, bytes, t0.elapsed());
            // `w` drops here: the window's slots may be evicted again.
            drop(slices);
            drop(w);
            window = prefix.next().await.map_err(io::Error::other)?;
        }
        Ok(())
    }
}
