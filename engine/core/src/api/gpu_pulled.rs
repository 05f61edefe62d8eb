//! Hinted GPU onloads: the keys this node lacks are pulled from the hinted peer, and pages go
//! into the GPU run by run as their blocks land verified ([`crate::peer::Arrivals`]), so the
//! DMA of the first pages overlaps the pull of the later ones. One task per onload owns its
//! leases and copy tickets; it releases each run's leases once that run's copies completed,
//! and answers with per-key statuses and the pull's report.

use std::ops::Range;
use std::sync::Arc;

use kvnode_gpu::{Canceller, CopyOp, DeviceWorker, Dir, GpuError};
use kvnode_proto::Key;
use kvnode_proto::gpu::{GpuLayout, OnloadStatus};
use kvnode_proto::pull::OpReport;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::gpu_copies::InFlight;
use super::listed_op::ListedOp;
use crate::peer::{Arrivals, Peers};
use crate::store::{Lease, Store};

/// What one streamed onload did.
#[derive(Debug)]
pub(super) struct Streamed {
    pub results: Vec<OnloadStatus>,
    /// Pages whose copies completed.
    pub loaded: u64,
    pub bytes_per_page: u64,
    pub pull: OpReport,
    /// The first copy error, if any (the reply is then that error).
    pub error: Option<GpuError>,
}

/// A streamed onload in flight: its task, and the signal that cancels it.
#[derive(Debug)]
pub(super) struct PulledOnload {
    task: JoinHandle<Streamed>,
    stop: watch::Sender<bool>,
}

impl PulledOnload {
    /// Cancels the pull and stops issuing copies; those already issued still complete.
    pub fn cancel(&self) {
        self.stop.send_replace(true);
    }

    /// Waits until every issued copy completed and the leases are released.
    pub async fn wait(self) -> Streamed {
        // Dropping `stop` first would cancel: it is kept alive across the wait.
        let _stop = self.stop;
        // A panic ends the daemon (docs/operations.md), so the task cannot fail here.
        self.task
            .await
            .expect("a pulled onload's task ended by panic")
    }
}

/// Where the pages go: a mapped GPU buffer and its layout.
#[derive(Debug)]
pub(super) struct Target {
    pub worker: Arc<DeviceWorker>,
    pub dev: u64,
    pub layout: GpuLayout,
}

/// One submitted run: its copies with the leases they read ([`InFlight`]), and the keys it
/// copies (with each key's copy end inside the run).
struct Run {
    copies: InFlight,
    ends: Vec<(usize, usize)>,
    ops: usize,
}

struct Stream {
    store: Arc<Store>,
    target: Target,
    ns: u32,
    keys: Vec<Key>,
    page_ids: Vec<u64>,
    results: Vec<OnloadStatus>,
    runs: Vec<Run>,
    cancels: Vec<Canceller>,
    loaded: u64,
    error: Option<GpuError>,
}

/// Starts the onload of `keys` into `page_ids` as `arrivals` reports them landed.
pub(super) fn start(
    peers: Arc<Peers>,
    store: Arc<Store>,
    target: Target,
    ns: u32,
    keys: Vec<Key>,
    page_ids: Vec<u64>,
    arrivals: Arrivals,
) -> PulledOnload {
    let (stop, stopped) = watch::channel(false);
    let n = keys.len();
    let s = Stream {
        store,
        target,
        ns,
        keys,
        page_ids,
        results: vec![OnloadStatus::Miss; n],
        runs: Vec::new(),
        cancels: Vec::new(),
        loaded: 0,
        error: None,
    };
    PulledOnload {
        task: tokio::spawn(s.run(peers, arrivals, stopped)),
        stop,
    }
}

/// Resolves once the onload is cancelled (or its owner is gone).
async fn cancelled(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

impl Stream {
    async fn run(
        mut self,
        peers: Arc<Peers>,
        mut arrivals: Arrivals,
        mut stopped: watch::Receiver<bool>,
    ) -> Streamed {
        let mut cancelled_by_client = false;
        loop {
            let run = tokio::select! {
                r = arrivals.next_run() => r,
                () = cancelled(&mut stopped) => {
                    cancelled_by_client = true;
                    None
                }
            };
            let Some(run) = run else { break };
            self.retire_completed().await;
            let handed = arrivals.op().take_leases(run.clone());
            if !self.submit(run, handed).await {
                break;
            }
        }
        // Left running (stopped early on a lease or copy failure), the pull goes on into the
        // DRAM tier until its deadline; the op table forgets it when this guard drops.
        let op = ListedOp::new(Arc::clone(&peers), Arc::clone(arrivals.op()));
        if cancelled_by_client {
            peers.cancel(op.op());
            self.cancel_copies();
        }
        while let Some(first) = self.runs.first() {
            // Waiting on the progress channel (not on the ticket) keeps the run and its
            // leases in place if the cancel branch wins.
            let (mut progress, ops) = (first.copies.progress(), first.ops);
            let settled = async move {
                let _ = progress.wait_for(|&d| d >= ops).await;
            };
            tokio::select! {
                biased;
                () = cancelled(&mut stopped), if !cancelled_by_client => {
                    cancelled_by_client = true;
                    self.cancel_copies();
                }
                () = settled => self.retire_first().await,
            }
        }
        if cancelled_by_client {
            for r in &mut self.results {
                if *r == OnloadStatus::Miss {
                    *r = OnloadStatus::Cancelled;
                }
            }
        }
        Streamed {
            results: self.results,
            loaded: self.loaded,
            bytes_per_page: self.target.layout.page_bytes(),
            pull: op.report(),
            error: self.error,
        }
    }

    fn cancel_copies(&self) {
        self.cancels.iter().for_each(Canceller::cancel);
    }

    /// Leases the run's keys and submits their copies. `handed[k]` is key `run.start + k`'s
    /// lease from its pull's commit, where the op kept one (a pulled page is then not looked
    /// up again); the rest (local hits) are held here. When DRAM cannot lease all of them at
    /// once (promotions past the hold limit, or no room), the copies in flight are waited
    /// for, their leases released, and the rest leased again. False: stop (a key vanished
    /// before its lease, no room even with nothing in flight, or a copy failed; the keys
    /// from there on stay `Miss`).
    async fn submit(&mut self, run: Range<usize>, mut handed: Vec<Option<Lease>>) -> bool {
        let mut at = run.start;
        while at < run.end {
            let Some((upto, leases)) = self.lease(at..run.end, &mut handed[at - run.start..]).await
            else {
                return false;
            };
            let (whole, copied) = self.copy_leased(at..upto, leases);
            if !copied || !whole {
                return false;
            }
            if upto == run.end {
                return true;
            }
            if upto == at && self.runs.is_empty() {
                return false;
            }
            while !self.runs.is_empty() {
                self.retire_first().await;
            }
            at = upto;
        }
        true
    }

    /// The leases of keys `range` in prefix order: those in `handed` (taken), the others
    /// held now. Returns where they end (short of `range.end` when DRAM had no room) and the
    /// leases up to there; `None` when the store refused.
    async fn lease(
        &self,
        range: Range<usize>,
        handed: &mut [Option<Lease>],
    ) -> Option<(usize, Vec<Option<Lease>>)> {
        let missing: Vec<usize> = range
            .clone()
            .filter(|&i| handed[i - range.start].is_none())
            .collect();
        let (mut held, mut upto) = (Vec::new(), range.end);
        if !missing.is_empty() {
            let keys: Vec<Key> = missing.iter().map(|&i| self.keys[i]).collect();
            match self.store.hold(self.ns, &keys, false).await {
                Ok(g) => {
                    upto = g.short.map_or(range.end, |s| missing[s]);
                    held = g.leases;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "leasing pulled pages for an onload failed");
                    return None;
                }
            }
        }
        let mut held = held.into_iter();
        let leases = (range.start..upto)
            .map(|i| match handed[i - range.start].take() {
                Some(l) => Some(l),
                None => held.next().flatten(),
            })
            .collect();
        Some((upto, leases))
    }

    /// Submits the copies of the leased keys `keys`. Returns (every key was leased, the
    /// copies were submitted).
    fn copy_leased(&mut self, keys: Range<usize>, leased: Vec<Option<Lease>>) -> (bool, bool) {
        let page_bytes = self.target.layout.page_bytes();
        let arena = self.store.arena().base() as usize;
        let (mut ops, mut ends, mut leases) = (Vec::<CopyOp>::new(), Vec::new(), Vec::new());
        let mut whole = true;
        for (i, l) in keys.zip(leased) {
            match l {
                // Landed, then gone before its lease (evicted or deleted): the prefix ends.
                None => {
                    whole = false;
                    break;
                }
                Some(b) if b.len() == page_bytes => {
                    let host = arena + b.extent().offset as usize;
                    kvnode_gpu::page_ops(
                        &self.target.layout,
                        self.target.dev,
                        host,
                        self.page_ids[i],
                        &mut ops,
                    );
                    ends.push((i, ops.len()));
                    leases.push(b);
                }
                Some(_) => self.results[i] = OnloadStatus::SizeMismatch,
            }
        }
        if ops.is_empty() {
            return (whole, true);
        }
        let n = ops.len();
        // SAFETY: every host range is a block leased by `leases`, which the run's `InFlight`
        // keeps until its copies' wait returned (`retire_first`), or for good if dropped.
        match unsafe {
            self.target
                .worker
                .submit(Dir::HostToDevice, self.target.dev, ops)
        } {
            Ok(ticket) => {
                self.cancels.push(ticket.canceller());
                self.runs.push(Run {
                    copies: InFlight::new(ticket, leases),
                    ends,
                    ops: n,
                });
                (whole, true)
            }
            Err(e) => {
                self.error.get_or_insert(e);
                (whole, false)
            }
        }
    }

    /// Retires the runs at the front whose copies have all completed (their leases end).
    async fn retire_completed(&mut self) {
        while self
            .runs
            .first()
            .is_some_and(|r| *r.copies.progress().borrow() >= r.ops)
        {
            self.retire_first().await;
        }
    }

    /// Waits for the first run's copies, records its keys, and releases its leases.
    async fn retire_first(&mut self) {
        if self.runs.is_empty() {
            return;
        }
        let mut run = self.runs.remove(0);
        let done = match run.copies.wait().await {
            Ok(d) => d,
            Err(e) => {
                self.error.get_or_insert(e);
                0
            }
        };
        for (i, end) in run.ends {
            self.results[i] = if end <= done {
                self.loaded += 1;
                OnloadStatus::Loaded
            } else {
                OnloadStatus::Cancelled
            };
        }
    }
}
