//! `Get`, served in prefix order (store/get.rs):
//!
//! - **Inline**: the reply header lists every block found (`Store::plan`); the payload
//!   then streams window by window (lease a window, promote what is on NVMe, write it to the
//!   socket, release it), with the next window promoted while the current one is written.
//!   DRAM use stays bounded by two windows whatever the get's length. A get that fits one
//!   window is leased whole before the header, as before.
//! - **Lease**: the client holds the pages, so they must all fit now: `Store::lease_prefix`;
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
use crate::store::{Lease, Store};
use crate::tenant::Held;

type Window = tokio::task::JoinHandle<Result<Vec<Option<Lease>>, crate::dram::TierError>>;

/// Starts leasing (and promoting) one window in its own task.
fn start_window(store: &Arc<Store>, ns: u32, keys: &[Key]) -> Window {
    let (s, keys) = (Arc::clone(store), keys.to_vec());
    // `lease`: in prefix order, waiting (bounded) for room held by other leases.
    tokio::spawn(async move { s.lease(ns, &keys).await })
}

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
        let got = match store.lease_prefix(ns, keys, store.hold_limit()).await {
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
        let plan = match store.plan(ns, keys) {
            Ok(p) => p,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        let total: u64 = plan.iter().map(|p| p.1).sum();
        if total > u64::from(MAX_PAYLOAD) {
            let msg = format!(
                "{total} bytes found exceed the 1 GiB frame limit: split the batch or use Lease mode"
            );
            return self.send(id, invalid(msg), &[]).await;
        }
        let windows = store.windows(&plan);
        if windows.len() <= 1 {
            // One window: lease it whole, then answer with what was really found.
            let leased = match store.lease(ns, keys).await {
                Ok(l) => l,
                Err(e) => return self.send(id, tier_error(&e), &[]).await,
            };
            let payload: Vec<&[u8]> = leased.iter().flatten().map(Lease::bytes).collect();
            let lens = leased.iter().map(|l| l.as_ref().map(Lease::len)).collect();
            return self
                .send(id, Reply::GetInline { lens, pull }, &payload)
                .await;
        }
        // Streamed: the first window is leased before the header, so a get whose head
        // cannot be had answers cleanly; later windows are promised by the plan.
        let mut next = Some(start_window(&store, ns, &keys[windows[0].clone()]));
        let first = join_window(next.take()).await;
        let first = match first {
            Ok(f) => f,
            Err(e) => return self.send(id, tier_error(&e), &[]).await,
        };
        let mut lens: Vec<Option<u64>> = plan
            .iter()
            .map(|&(at, l)| at.is_local().then_some(l))
            .collect();
        let mut windows = windows;
        for (j, i) in windows[0].clone().enumerate() {
            if first.get(j).is_none_or(Option::is_none) {
                lens[i] = None;
                if plan[i].0.is_local() && store.still_local(ns, &keys[i]) {
                    // No room even for the first window (DRAM is full of other leases): the
                    // answer is the prefix leased so far, nothing after it.
                    lens[i..].iter_mut().for_each(|l| *l = None);
                    windows.truncate(1);
                    break;
                }
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
        let mut cur = Some(first);
        for (n, w) in windows.iter().enumerate() {
            let leased = match cur.take() {
                Some(l) => l,
                None => join_window(next.take()).await.map_err(io::Error::other)?,
            };
            if let Some(w) = windows.get(n + 1) {
                next = Some(start_window(&store, ns, &keys[w.clone()]));
            }
            let mut slices = Vec::with_capacity(w.len());
            for (j, i) in w.clone().enumerate() {
                match (lens[i], leased.get(j).and_then(Option::as_ref)) {
                    (None, _) => {}
                    (Some(len), Some(b)) if b.len() == len => slices.push(IoSlice::new(b.bytes())),
                    (Some(_), _) => return Err(vanished(i)),
                }
            }
            self.io.write_all(&mut slices).await?;
            // `leased` drops here: the window's slots may be evicted again.
        }
        Ok(())
    }
}

/// Waits for a window started by [`start_window`].
async fn join_window(w: Option<Window>) -> Result<Vec<Option<Lease>>, crate::dram::TierError> {
    match w {
        Some(w) => w.await.unwrap_or_else(|_| Ok(Vec::new())),
        None => Ok(Vec::new()),
    }
}
