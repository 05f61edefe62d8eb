//! GPU ops of a connection: attach an IPC-exported buffer, offload pages into reserved slots
//! (commit after the copies complete), onload leased blocks into pages (reply after the copies
//! complete), and close every mapping when the connection ends, after its copies finish.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvnode_gpu::{CopyOp, CopyTicket, DeviceWorker, Dir, GpuError};
use kvnode_proto::client::{CommitStatus, ErrorCode, Op, PutStatus, Reply};
use kvnode_proto::gpu::{AttachGpu, GpuLayout, LayoutError, OnloadStatus, PageMove, check_handle};

use super::conn::Connection;
use super::handler::tier_error;
use crate::policy::SlotId;
use crate::tier::Reservation;

/// A mapped buffer.
#[derive(Debug)]
struct Attached {
    worker: Arc<DeviceWorker>,
    dev: u64,
    layout: GpuLayout,
}

/// An onload whose copies were submitted.
#[derive(Debug)]
pub(super) struct PendingOnload {
    ticket: CopyTicket,
    slots: Vec<SlotId>,
    results: Vec<OnloadStatus>,
    /// Per key: index one past its last copy, for keys whose copies were submitted.
    ends: Vec<Option<usize>>,
    bytes_per_page: u64,
}

/// GPU state owned by one connection.
#[derive(Debug, Default)]
pub(super) struct GpuConn {
    buffers: Vec<Attached>,
    onloads: HashMap<u64, PendingOnload>,
}

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

impl Connection {
    /// Runs one GPU op.
    pub(super) async fn gpu_op(&mut self, op: Op) -> Reply {
        let r = match op {
            Op::AttachGpu(a) => self.attach_gpu(a).await,
            Op::Offload(m) => self.offload(&m).await,
            Op::Onload(m) => match self.start_onload(&m) {
                Ok(p) => Ok(self.finish_onload(p).await),
                Err(r) => Err(r),
            },
            Op::OnloadAsync(m) => self.start_onload(&m).map(|p| {
                let ticket = self.next_handle;
                self.next_handle += 1;
                self.gpu.onloads.insert(ticket, p);
                Reply::OnloadStarted { ticket }
            }),
            Op::OnloadWait { ticket } | Op::OnloadCancel { ticket } => {
                let cancel = matches!(op, Op::OnloadCancel { .. });
                match self.gpu.onloads.remove(&ticket) {
                    Some(p) => {
                        if cancel {
                            p.ticket.cancel();
                        }
                        Ok(self.finish_onload(p).await)
                    }
                    None => Err(Reply::Error {
                        code: ErrorCode::NotOwned,
                        message: format!(
                            "onload ticket {ticket} is not pending on this connection (already waited?)"
                        ),
                    }),
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

    /// Copies `(dev, host)` extents of page `p` into `ops`.
    fn page_ops(a: &Attached, base: usize, p: u64, ops: &mut Vec<CopyOp>) {
        ops.extend(a.layout.extents(p).map(|(dev, in_block, len)| CopyOp {
            dev: a.dev + dev,
            host: base + in_block as usize,
            len,
        }));
    }

    async fn offload(&mut self, m: &PageMove) -> Result<Reply, Reply> {
        let a = self.buffer(m)?;
        let page_bytes = a.layout.page_bytes();
        let lens = vec![page_bytes; m.keys.len()];
        let reserved = self
            .engine
            .tier
            .reserve(self.id, m.ns, &m.keys, &lens)
            .map_err(|e| tier_error(&e))?;
        let arena = self.engine.arena.base() as usize;
        let mut ops = Vec::new();
        let mut held: Vec<Reservation> = Vec::new();
        for (r, &p) in reserved.iter().zip(&m.page_ids) {
            if let Ok(res) = r {
                Self::page_ops(a, arena + res.offset as usize, p, &mut ops);
                held.push(*res);
            }
        }
        let n = ops.len();
        // SAFETY: every host range is a slot this connection holds reserved until the commit
        // or abort below, which run only after the ticket's wait (all copies complete).
        let done = match unsafe { a.worker.submit(Dir::DeviceToHost, a.dev, ops) } {
            Ok(t) => t.wait().await,
            Err(e) => Err(e),
        };
        if !matches!(done, Ok(d) if d == n) {
            self.engine.tier.abort(self.id, &held);
            return Err(match done {
                Err(e) => gpu_error(&e),
                Ok(_) => Reply::Error {
                    code: ErrorCode::Internal,
                    message: "offload copies stopped early".into(),
                },
            });
        }
        let committed = self.engine.tier.commit(self.id, &held);
        let stored = committed
            .iter()
            .filter(|c| **c == CommitStatus::Committed)
            .count() as u64;
        self.engine
            .gpu
            .counters
            .offload_bytes
            .fetch_add(held.len() as u64 * page_bytes, Ordering::Relaxed);
        let mut it = committed.into_iter();
        let results = reserved
            .iter()
            .map(|r| match r {
                Err(status) => *status,
                Ok(_) => match it.next() {
                    Some(CommitStatus::Committed) => PutStatus::Stored,
                    _ => PutStatus::Exists,
                },
            })
            .collect();
        tracing::debug!(conn = self.id, pages = m.keys.len(), stored, "offload done");
        Ok(Reply::Offloaded { results })
    }

    fn start_onload(&mut self, m: &PageMove) -> Result<PendingOnload, Reply> {
        let a = self.buffer(m)?;
        let page_bytes = a.layout.page_bytes();
        let leased = self
            .engine
            .tier
            .lease(m.ns, &m.keys)
            .map_err(|e| tier_error(&e))?;
        let arena = self.engine.arena.base() as usize;
        let (mut ops, mut slots, mut results, mut ends) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (l, &p) in leased.iter().zip(&m.page_ids) {
            let (status, end) = match l {
                None => (OnloadStatus::Miss, None),
                Some(b) => {
                    slots.push(b.slot);
                    if b.extent.len == page_bytes {
                        Self::page_ops(a, arena + b.extent.offset as usize, p, &mut ops);
                        (OnloadStatus::Loaded, Some(ops.len()))
                    } else {
                        (OnloadStatus::SizeMismatch, None)
                    }
                }
            };
            results.push(status);
            ends.push(end);
        }
        // SAFETY: every host range is a block leased until `finish_onload` releases it, after
        // the ticket's wait (or, on disconnect, `gpu_cleanup` waits before releasing).
        match unsafe { a.worker.submit(Dir::HostToDevice, a.dev, ops) } {
            Ok(ticket) => Ok(PendingOnload {
                ticket,
                slots,
                results,
                ends,
                bytes_per_page: page_bytes,
            }),
            Err(e) => {
                self.engine.tier.release(&slots);
                Err(gpu_error(&e))
            }
        }
    }

    async fn finish_onload(&mut self, p: PendingOnload) -> Reply {
        let done = p.ticket.wait().await;
        self.engine.tier.release(&p.slots);
        let done = match done {
            Ok(d) => d,
            Err(e) => return gpu_error(&e),
        };
        let mut results = p.results;
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
        self.engine
            .gpu
            .counters
            .onload_bytes
            .fetch_add(loaded * p.bytes_per_page, Ordering::Relaxed);
        Reply::Onloaded { results }
    }

    /// Cancels pending onloads, waits for every copy, releases their leases, and closes the
    /// connection's IPC mappings. Runs when the connection ends, whatever the reason.
    pub(super) async fn gpu_cleanup(&mut self) {
        let pending: Vec<PendingOnload> = self.gpu.onloads.drain().map(|(_, p)| p).collect();
        for p in pending {
            p.ticket.cancel();
            let _ = p.ticket.wait().await;
            self.engine.tier.release(&p.slots);
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
