//! GPU ops of a connection: attach an IPC-exported buffer, offload pages into reserved slots
//! (commit after the copies complete), onload leased blocks into pages (reply after the copies
//! complete; layer-wise onloads copy layer by layer and answer `OnloadLayerWait` per layer),
//! and close every mapping when the connection ends, after its copies finish. A hinted onload
//! pulls what this node lacks and copies each page as it lands (gpu_pulled.rs).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvnode_gpu::{CopyOp, Dir, GpuError};
use kvnode_proto::client::{CommitStatus, ErrorCode, Op, PutStatus, Reply};
use kvnode_proto::gpu::{AttachGpu, LayoutError, OnloadStatus, PageMove, check_handle};

use super::errors::{error, tier_error, too_large};
use super::gpu_conn::{Attached, Onload, PendingOnload};
use super::gpu_copies::InFlight;
use super::gpu_pulled::{self, PulledOnload, Target};
use super::session::Session;
use crate::peer::{Arrivals, PullRequest};
use crate::store::Reservation;
use crate::tenant::Held;

fn gpu_error(e: &GpuError) -> Reply {
    let code = match e {
        GpuError::NoDriver => ErrorCode::Unsupported,
        GpuError::Layout(_) | GpuError::NoDevice { .. } => ErrorCode::Invalid,
        _ => ErrorCode::Internal,
    };
    Reply::Error {
        code,
        message: e.to_string(),
    }
}

fn layout_error(e: LayoutError) -> Reply {
    gpu_error(&GpuError::Layout(e))
}

fn not_pending(ticket: u64) -> Reply {
    Reply::Error {
        code: ErrorCode::NotOwned,
        message: format!(
            "onload ticket {ticket} is not pending on this connection (already waited?)"
        ),
    }
}

impl Session {
    /// Runs one GPU op.
    pub(super) async fn gpu_op(&mut self, op: Op) -> Reply {
        let r = match op {
            Op::AttachGpu(a) => self.attach_gpu(a).await,
            Op::Offload(m) => self.offload(&m).await,
            Op::Onload(m) => match self.start_any_onload(&m).await {
                Ok(p) => Ok(self.finish_any(p).await),
                Err(r) => Err(r),
            },
            Op::OnloadAsync(m) => {
                // Its leases outlive the request (until OnloadWait): charged per key named.
                match self.charge(Held::LeasedBlocks, m.keys.len() as u64) {
                    Ok(charge) => self.start_any_onload(&m).await.map(|p| {
                        let ticket = self.next_id();
                        self.gpu.onloads.insert(ticket, p);
                        self.gpu.charges.insert(ticket, charge);
                        Reply::OnloadStarted { ticket }
                    }),
                    Err(over) => Err(error(ErrorCode::LimitReached, over.to_string())),
                }
            }
            Op::OnloadLayerWait { ticket, layer } => self.onload_layer_wait(ticket, layer).await,
            Op::OnloadWait { ticket } | Op::OnloadCancel { ticket } => {
                let cancel = matches!(op, Op::OnloadCancel { .. });
                // Given back after the copies, with the leases.
                let _charge = self.gpu.charges.remove(&ticket);
                match self.gpu.onloads.remove(&ticket) {
                    Some(p) => {
                        if cancel {
                            p.cancel();
                        }
                        Ok(self.finish_any(p).await)
                    }
                    None => Err(not_pending(ticket)),
                }
            }
            other => Err(Reply::Error {
                code: ErrorCode::Internal,
                message: format!("not a GPU op: {other:?}"),
            }),
        };
        r.unwrap_or_else(|e| e)
    }

    async fn attach_gpu(&mut self, a: AttachGpu) -> Result<Reply, Reply> {
        let handle = check_handle(&a.handle).map_err(layout_error)?;
        a.layout.validate(a.len).map_err(layout_error)?;
        // A mapping in the daemon, like a region: charged under the uid's regions_per_uid.
        let charge = self
            .charge(Held::Regions, 1)
            .map_err(|over| error(ErrorCode::LimitReached, over.to_string()))?;
        let worker = self
            .engine
            .gpu
            .worker(a.device)
            .map_err(|e| gpu_error(&e))?;
        let dev = worker
            .open(handle, a.len)
            .await
            .map_err(|e| gpu_error(&e))?;
        let page_bytes = a.layout.page_bytes();
        let buffer = self.gpu.buffers.len() as u32;
        tracing::info!(
            conn = self.id,
            buffer,
            device = a.device,
            len = a.len,
            pages = a.layout.pages,
            page_bytes,
            "GPU buffer attached"
        );
        self.gpu.buffers.push(Attached {
            worker,
            dev,
            layout: a.layout,
            _charge: charge,
        });
        self.engine
            .gpu
            .counters
            .attached
            .fetch_add(1, Ordering::Relaxed);
        Ok(Reply::GpuAttached { buffer, page_bytes })
    }

    fn buffer(&self, m: &PageMove) -> Result<&Attached, Reply> {
        let a = self
            .gpu
            .buffers
            .get(m.buffer as usize)
            .ok_or_else(|| Reply::Error {
                code: ErrorCode::NotOwned,
                message: format!(
                    "no GPU buffer {} is attached on this connection: send AttachGpu first",
                    m.buffer
                ),
            })?;
        a.layout
            .check_pages(m.keys.len(), &m.page_ids)
            .map_err(layout_error)?;
        Ok(a)
    }

    /// Appends the copies of page `p` (one strided copy for a regular layout) to `ops`.
    fn page_ops(a: &Attached, base: usize, p: u64, ops: &mut Vec<CopyOp>) {
        kvnode_gpu::page_ops(&a.layout, a.dev, base, p, ops);
    }

    async fn offload(&mut self, m: &PageMove) -> Result<Reply, Reply> {
        let store = Arc::clone(&self.engine.store);
        let a = self.buffer(m)?;
        if m.layers != 0 {
            return Err(Reply::Error {
                code: ErrorCode::Invalid,
                message: "layers applies to onloads only: send Offload with layers 0".into(),
            });
        }
        let page_bytes = a.layout.page_bytes();
        let lens = vec![page_bytes; m.keys.len()];
        // Like a put: wait (bounded) for demotion to make room rather than evict uncopied.
        store.make_room(lens.iter().sum()).await;
        let a = self.buffer(m)?;
        let reserved = store
            .reserve(self.id, m.ns, &m.keys, &lens)
            .map_err(|e| tier_error(&e))?;
        let arena = store.arena().base() as usize;
        let mut ops = Vec::new();
        for (r, &p) in reserved.iter().zip(&m.page_ids) {
            if let Ok(res) = r {
                Self::page_ops(a, arena + res.offset() as usize, p, &mut ops);
            }
        }
        let n = ops.len();
        // SAFETY: every host range is a slot held reserved by `reserved` until the commit
        // below or its drop on error, both after the ticket's wait (all copies complete).
        let done = match unsafe { a.worker.submit(Dir::DeviceToHost, a.dev, ops) } {
            Ok(t) => t.wait().await,
            Err(e) => Err(e),
        };
        if !matches!(done, Ok(d) if d == n) {
            return Err(match done {
                Err(e) => gpu_error(&e),
                Ok(_) => Reply::Error {
                    code: ErrorCode::Internal,
                    message: "offload copies stopped early".into(),
                },
            });
        }
        let mut copied = 0u64;
        let results: Vec<PutStatus> = reserved
            .into_iter()
            .map(|r| {
                r.map(|res: Reservation| {
                    copied += 1;
                    match res.commit() {
                        CommitStatus::Committed => PutStatus::Stored,
                        _ => PutStatus::Exists,
                    }
                })
            })
            .map(|r| r.unwrap_or_else(|status| status))
            .collect();
        let stored = results.iter().filter(|r| **r == PutStatus::Stored).count();
        self.engine
            .gpu
            .counters
            .offload_bytes
            .fetch_add(copied * page_bytes, Ordering::Relaxed);
        tracing::debug!(conn = self.id, pages = m.keys.len(), stored, "offload done");
        Ok(Reply::Offloaded { results })
    }

    /// Starts an onload: a hinted one streams pulled pages (gpu_pulled.rs).
    async fn start_any_onload(&mut self, m: &PageMove) -> Result<Onload, Reply> {
        match &m.hint {
            Some(hint) => self.start_pulled_onload(m, hint).await.map(Onload::Pulled),
            None => self.start_onload(m).await.map(Onload::Copies),
        }
    }

    async fn start_pulled_onload(
        &mut self,
        m: &PageMove,
        hint: &str,
    ) -> Result<PulledOnload, Reply> {
        if m.layers > 0 {
            return Err(Reply::Error {
                code: ErrorCode::Invalid,
                message: "a hinted onload goes page by page as blocks land: send layers 0 (or pull first, then onload layer-wise)".into(),
            });
        }
        let a = self.buffer(m)?;
        let target = Target {
            worker: Arc::clone(&a.worker),
            dev: a.dev,
            layout: a.layout.clone(),
        };
        let req = PullRequest {
            deadline_ms: m.deadline_ms,
            hand_leases: true,
            ..self.request(m.ns, &m.keys, hint).await
        };
        let peers = Arc::clone(&self.engine.peers);
        let op = peers.start(req).await;
        Ok(gpu_pulled::start(
            peers,
            Arc::clone(&self.engine.store),
            target,
            m.ns,
            m.keys.clone(),
            m.page_ids.clone(),
            Arrivals::new(op),
        ))
    }

    async fn finish_any(&mut self, o: Onload) -> Reply {
        match o {
            Onload::Copies(p) => self.finish_onload(p).await,
            Onload::Pulled(p) => {
                let s = p.wait().await;
                if let Some(e) = &s.error {
                    return gpu_error(e);
                }
                self.count_onloaded(s.loaded * s.bytes_per_page);
                Reply::Onloaded {
                    results: s.results,
                    pull: Some(Box::new(s.pull)),
                }
            }
        }
    }

    fn count_onloaded(&self, bytes: u64) {
        self.engine
            .gpu
            .counters
            .onload_bytes
            .fetch_add(bytes, Ordering::Relaxed);
    }

    async fn start_onload(&mut self, m: &PageMove) -> Result<PendingOnload, Reply> {
        let store = Arc::clone(&self.engine.store);
        let layered = m.layers > 0;
        if layered {
            self.buffer(m)?
                .layout
                .layer_bytes(m.layers)
                .map_err(layout_error)?;
        }
        self.buffer(m)?;
        // In prefix order; pages that cannot all be leased now are refused as a whole.
        let got = store
            .hold(m.ns, &m.keys, false)
            .await
            .map_err(|e| tier_error(&e))?;
        if let Some(n) = got.short {
            return Err(too_large(n, m.keys.len(), store.hold_limit()));
        }
        let leased = got.leases;
        let a = self.buffer(m)?;
        let page_bytes = a.layout.page_bytes();
        let arena = store.arena().base() as usize;
        let (mut ops, mut leases, mut results, mut ends) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut rows = Vec::new(); // layer-wise: (block address, page id), planned below
        for (l, &p) in leased.into_iter().zip(&m.page_ids) {
            let (status, end) = match l {
                None => (OnloadStatus::Miss, None),
                Some(b) if b.len() == page_bytes => {
                    let host = arena + b.extent().offset as usize;
                    if layered {
                        rows.push((host, p));
                    } else {
                        Self::page_ops(a, host, p, &mut ops);
                    }
                    leases.push(b);
                    (OnloadStatus::Loaded, Some(ops.len()))
                }
                Some(_) => (OnloadStatus::SizeMismatch, None),
            };
            results.push(status);
            ends.push(end);
        }
        let mut layer_ends = Vec::new();
        if layered {
            // Every page is whole only once the last layer landed.
            let regs = self.engine.gpu.host_pieces();
            let plan = kvnode_gpu::layer_ops(&a.layout, a.dev, &rows, m.layers, regs)
                .map_err(layout_error)?;
            (ops, layer_ends) = (plan.ops, plan.layer_ends);
            ends.iter_mut().flatten().for_each(|e| *e = ops.len());
        }
        // SAFETY: every host range is a block leased by `leases`, which the pending onload
        // keeps until its ticket's wait returned (or, dropped unwaited, forever).
        match unsafe { a.worker.submit_with(Dir::HostToDevice, a.dev, ops, layered) } {
            Ok(ticket) => {
                Ok(
                    PendingOnload::new(InFlight::new(ticket, leases), results, ends, page_bytes)
                        .layered(layer_ends)
                        .measure(std::sync::Arc::clone(&self.engine.metrics)),
                )
            }
            Err(e) => Err(gpu_error(&e)),
        }
    }

    /// Waits until `layer` of a pending layer-wise onload has landed (or the onload stopped).
    async fn onload_layer_wait(&mut self, ticket: u64, layer: u32) -> Result<Reply, Reply> {
        let o = self
            .gpu
            .onloads
            .get(&ticket)
            .ok_or_else(|| not_pending(ticket))?;
        let Onload::Copies(p) = o else {
            return Err(Reply::Error {
                code: ErrorCode::Invalid,
                message: format!(
                    "onload {ticket} is a hinted onload, page by page: it is not layer-wise"
                ),
            });
        };
        let Some(&end) = p.layer_ends.get(layer as usize) else {
            let message = if p.layer_ends.is_empty() {
                format!("onload {ticket} is not layer-wise: start it with layers > 0")
            } else {
                format!(
                    "layer {layer} is out of range: onload {ticket} has {} layers",
                    p.layer_ends.len()
                )
            };
            return Err(Reply::Error {
                code: ErrorCode::Invalid,
                message,
            });
        };
        let mut rx = p.progress.clone();
        // The channel closes when the copies ended: its last value is then final.
        let reached = rx.wait_for(|&done| done >= end).await.is_ok();
        let complete = reached || *rx.borrow() >= end;
        Ok(Reply::LayerLoaded {
            ticket,
            layer,
            complete,
        })
    }

    async fn finish_onload(&mut self, mut p: PendingOnload) -> Reply {
        let done = match p.wait().await {
            Ok(d) => d,
            Err(e) => return gpu_error(&e),
        };
        let mut results = std::mem::take(&mut p.results);
        let mut loaded = 0u64;
        for (r, end) in results.iter_mut().zip(&p.ends) {
            if let Some(end) = end {
                if *end <= done {
                    loaded += 1;
                } else {
                    *r = OnloadStatus::Cancelled;
                }
            }
        }
        self.count_onloaded(loaded * p.bytes_per_page);
        Reply::Onloaded {
            results,
            pull: None,
        }
    }

    /// Cancels pending onloads, waits for every copy, releases their leases, and closes the
    /// connection's IPC mappings. Runs when the connection ends, whatever the reason.
    pub(super) async fn gpu_cleanup(&mut self) {
        let pending: Vec<Onload> = self.gpu.onloads.drain().map(|(_, p)| p).collect();
        // Given back once the copies below are done (their leases with them).
        let _charges = std::mem::take(&mut self.gpu.charges);
        for o in pending {
            o.cancel();
            match o {
                Onload::Copies(mut p) => drop(p.wait().await),
                Onload::Pulled(p) => drop(p.wait().await),
            }
        }
        let buffers = std::mem::take(&mut self.gpu.buffers);
        if !buffers.is_empty() {
            tracing::info!(
                conn = self.id,
                buffers = buffers.len(),
                "closing the client's GPU mappings"
            );
        }
        for b in buffers {
            if let Err(e) = b.worker.close(b.dev).await {
                tracing::warn!(conn = self.id, error = %e, "closing a GPU mapping failed");
            }
            self.engine
                .gpu
                .counters
                .attached
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}
