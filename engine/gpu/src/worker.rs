//! One thread per device: opens and closes IPC mappings and runs copy jobs in fenced batches.
//!
//! A job's copies are issued in batches of about `batch_bytes`, at most `max_inflight`
//! batches ahead of the last completed fence; a batch closes only after a copy that ends a
//! unit ([`CopyOp::unit_end`]: the last copy of a page), so a cancel never splits a page. Cancelling stops issuing; the job's reply
//! comes only after every issued batch's fence has completed, so once a cancel's reply is
//! seen nothing of that job is still writing. A mapping is closed only when no job on it is
//! active. Tokio tasks talk to the thread over a channel and await oneshot replies.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use kvnode_proto::gpu::{IPC_HANDLE_LEN, LayoutError};
use tokio::sync::{oneshot, watch};

use crate::GpuError;
use crate::backend::{Backend, CopyOp, Dir};

/// Batching knobs.
#[derive(Debug, Clone, Copy)]
pub struct WorkerConfig {
    /// Bytes per fenced batch (cancel granularity). Default 16 MiB.
    pub batch_bytes: u64,
    /// Batches issued ahead of the oldest incomplete one. Default 4.
    pub max_inflight: usize,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            batch_bytes: 16 << 20,
            max_inflight: 4,
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, GpuError>>;

enum Cmd {
    Open {
        handle: [u8; IPC_HANDLE_LEN],
        len: u64,
        reply: Reply<u64>,
    },
    Close {
        dev: u64,
        reply: Reply<()>,
    },
    Copy(Job),
}

struct Job {
    dir: Dir,
    mapping: u64,
    ops: Vec<CopyOp>,
    /// Close a batch (fence) after every unit end, not only past `batch_bytes`: a layer-wise
    /// onload reports each layer as soon as it landed.
    fence_every_unit: bool,
    cancel: Arc<AtomicBool>,
    /// Leading copies completed so far (sent after each fence).
    progress: watch::Sender<usize>,
    reply: Reply<usize>,
}

struct Active<F> {
    job: Job,
    next: usize,
    inflight: VecDeque<(F, usize)>,
    done: usize,
    err: Option<GpuError>,
}

/// Handle to a device thread.
#[derive(Debug)]
pub struct DeviceWorker {
    device: u32,
    tx: mpsc::Sender<Cmd>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cmd")
    }
}

/// Cancels one copy job (see [`CopyTicket::canceller`]).
#[derive(Debug, Clone)]
pub struct Canceller(Arc<AtomicBool>);

impl Canceller {
    /// Stops issuing the job's further batches (those issued still complete).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A submitted copy job: await its completion, or cancel it first.
#[derive(Debug)]
pub struct CopyTicket {
    device: u32,
    cancel: Arc<AtomicBool>,
    progress: watch::Receiver<usize>,
    rx: oneshot::Receiver<Result<usize, GpuError>>,
}

impl CopyTicket {
    /// Leading copies completed so far, updated after each fence; the channel closes when the
    /// job ended (its last value is then final).
    pub fn progress(&self) -> watch::Receiver<usize> {
        self.progress.clone()
    }

    /// Stops issuing further batches (those issued still complete).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// A handle that cancels this job like [`CopyTicket::cancel`], kept after the ticket
    /// was handed to [`CopyTicket::wait`].
    pub fn canceller(&self) -> Canceller {
        Canceller(Arc::clone(&self.cancel))
    }

    /// Waits until every issued copy has completed; returns how many leading copies completed.
    pub async fn wait(self) -> Result<usize, GpuError> {
        self.rx
            .await
            .unwrap_or(Err(GpuError::WorkerGone(self.device)))
    }
}

impl DeviceWorker {
    /// Starts the thread; `make` builds the backend on it (a CUDA context is per thread).
    /// If `make` fails, every request is answered with its error.
    pub fn spawn<B: Backend>(
        device: u32,
        cfg: WorkerConfig,
        make: impl FnOnce() -> Result<B, GpuError> + Send + 'static,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("kvnode-gpu{device}"))
            .spawn(move || match make() {
                Ok(b) => run(b, &rx, cfg),
                Err(e) => {
                    tracing::warn!(device, error = %e, "GPU copy thread cannot start");
                    refuse(&rx, &e);
                }
            })
            .expect("spawn GPU copy thread");
        Self { device, tx }
    }

    fn send(&self, c: Cmd) -> Result<(), GpuError> {
        self.tx
            .send(c)
            .map_err(|_| GpuError::WorkerGone(self.device))
    }

    /// Opens an IPC handle and checks `len` against the allocation; returns its device address.
    pub async fn open(&self, handle: [u8; IPC_HANDLE_LEN], len: u64) -> Result<u64, GpuError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Open { handle, len, reply })?;
        rx.await.unwrap_or(Err(GpuError::WorkerGone(self.device)))
    }

    /// Closes a mapping once no job on it is active.
    pub async fn close(&self, dev: u64) -> Result<(), GpuError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Close { dev, reply })?;
        rx.await.unwrap_or(Err(GpuError::WorkerGone(self.device)))
    }

    /// Submits copies on `mapping`.
    ///
    /// # Safety
    /// Every op's host range stays valid and untouched by anyone else until the ticket's
    /// wait returns (or, if the ticket is dropped, until the job completes on its own).
    pub unsafe fn submit(
        &self,
        dir: Dir,
        mapping: u64,
        ops: Vec<CopyOp>,
    ) -> Result<CopyTicket, GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.submit_with(dir, mapping, ops, false) }
    }

    /// [`DeviceWorker::submit`], with `fence_every_unit`: a fence after every unit end (each
    /// layer of a layer-wise plan), so [`CopyTicket::progress`] moves unit by unit.
    ///
    /// # Safety
    /// As [`DeviceWorker::submit`].
    pub unsafe fn submit_with(
        &self,
        dir: Dir,
        mapping: u64,
        ops: Vec<CopyOp>,
        fence_every_unit: bool,
    ) -> Result<CopyTicket, GpuError> {
        let cancel = Arc::new(AtomicBool::new(false));
        let (reply, rx) = oneshot::channel();
        let (progress, progress_rx) = watch::channel(0);
        self.send(Cmd::Copy(Job {
            dir,
            mapping,
            ops,
            fence_every_unit,
            cancel: Arc::clone(&cancel),
            progress,
            reply,
        }))?;
        Ok(CopyTicket {
            device: self.device,
            cancel,
            progress: progress_rx,
            rx,
        })
    }
}

fn refuse(rx: &mpsc::Receiver<Cmd>, e: &GpuError) {
    while let Ok(c) = rx.recv() {
        match c {
            Cmd::Open { reply, .. } => drop(reply.send(Err(e.clone()))),
            Cmd::Close { reply, .. } => drop(reply.send(Err(e.clone()))),
            Cmd::Copy(j) => drop(j.reply.send(Err(e.clone()))),
        }
    }
}

fn open<B: Backend>(b: &mut B, handle: &[u8; IPC_HANDLE_LEN], len: u64) -> Result<u64, GpuError> {
    let (dev, alloc) = b.open(handle)?;
    if len > alloc {
        let _ = b.close(dev);
        return Err(LayoutError::BeyondAllocation { len, alloc }.into());
    }
    Ok(dev)
}

fn issue<B: Backend>(b: &mut B, a: &mut Active<B::Fence>, cfg: WorkerConfig) {
    while a.err.is_none()
        && a.inflight.len() < cfg.max_inflight
        && a.next < a.job.ops.len()
        && !a.job.cancel.load(Ordering::Acquire)
    {
        let mut bytes = 0;
        while a.next < a.job.ops.len() {
            let op = a.job.ops[a.next];
            // SAFETY: the submitter keeps the host range valid and exclusive until the
            // job's reply, which is sent only after this batch's fence completes.
            if let Err(e) = unsafe { b.copy(a.job.dir, op) } {
                a.err = Some(e);
                break;
            }
            bytes += op.bytes();
            a.next += 1;
            if op.unit_end && (a.job.fence_every_unit || bytes >= cfg.batch_bytes) {
                break;
            }
        }
        match b.fence(a.job.dir) {
            Ok(f) => a.inflight.push_back((f, a.next)),
            Err(e) => {
                a.err.get_or_insert(e);
            }
        }
    }
}

fn run<B: Backend>(mut b: B, rx: &mpsc::Receiver<Cmd>, cfg: WorkerConfig) {
    let mut active: VecDeque<Active<B::Fence>> = VecDeque::new();
    let mut closing: Vec<(u64, Reply<()>)> = Vec::new();
    loop {
        let mut cmds = Vec::new();
        if active.is_empty() {
            match rx.recv() {
                Ok(c) => cmds.push(c),
                Err(_) => return,
            }
        }
        cmds.extend(rx.try_iter());
        for c in cmds {
            match c {
                Cmd::Open { handle, len, reply } => {
                    let _ = reply.send(open(&mut b, &handle, len));
                }
                Cmd::Close { dev, reply } => closing.push((dev, reply)),
                Cmd::Copy(job) => active.push_back(Active {
                    job,
                    next: 0,
                    inflight: VecDeque::new(),
                    done: 0,
                    err: None,
                }),
            }
        }
        for a in &mut active {
            issue(&mut b, a, cfg);
        }
        if let Some(a) = active.iter_mut().find(|a| !a.inflight.is_empty()) {
            let (f, end) = a.inflight.pop_front().expect("non-empty");
            match b.wait(f) {
                Ok(()) => {
                    a.done = end;
                    a.job.progress.send_replace(end);
                }
                Err(e) => {
                    a.err.get_or_insert(e);
                }
            }
        }
        let mut i = 0;
        while i < active.len() {
            let a = &active[i];
            let stopped = a.next == a.job.ops.len()
                || a.err.is_some()
                || a.job.cancel.load(Ordering::Acquire);
            if a.inflight.is_empty() && stopped {
                let a = active.remove(i).expect("index in range");
                let _ = a.job.reply.send(a.err.map_or(Ok(a.done), Err));
            } else {
                i += 1;
            }
        }
        let (ready, busy): (Vec<_>, Vec<_>) = closing
            .drain(..)
            .partition(|(dev, _)| !active.iter().any(|a| a.job.mapping == *dev));
        closing = busy;
        for (dev, reply) in ready {
            let _ = reply.send(b.close(dev));
        }
    }
}
