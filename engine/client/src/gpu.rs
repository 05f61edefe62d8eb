//! GPU ops: attach an IPC-exported buffer, offload and onload pages, register the arena mapping.

use kvnode_gpu::register::HostRegistration;
use kvnode_proto::Key;
use kvnode_proto::client::{Op, PutStatus, Reply};
use kvnode_proto::gpu::{AttachGpu, GpuLayout, OnloadStatus, PageMove};
use kvnode_proto::pull::OpReport;

use crate::{Client, Result, unexpected};

/// A GPU buffer attached on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuBuffer {
    /// Id for page moves.
    pub id: u32,
    /// Bytes of each page's block.
    pub page_bytes: u64,
}

fn page_move(buffer: GpuBuffer, ns: u32, keys: &[Key], page_ids: &[u64]) -> PageMove {
    PageMove {
        ns,
        keys: keys.to_vec(),
        page_ids: page_ids.to_vec(),
        buffer: buffer.id,
        layers: 0,
        hint: None,
        deadline_ms: None,
    }
}

impl Client {
    /// Lets the daemon map a GPU allocation exported with `cuIpcGetMemHandle`. `len` bytes from
    /// the allocation's start must hold every page of `layout`. The mapping lasts until this
    /// connection closes.
    pub fn attach_gpu(
        &mut self,
        handle: &[u8],
        device: u32,
        len: u64,
        layout: GpuLayout,
    ) -> Result<GpuBuffer> {
        match self.call(Op::AttachGpu(AttachGpu {
            handle: handle.to_vec().into(),
            device,
            len,
            layout,
        }))? {
            Reply::GpuAttached { buffer, page_bytes } => Ok(GpuBuffer {
                id: buffer,
                page_bytes,
            }),
            r => Err(unexpected(&r)),
        }
    }

    /// Copies GPU pages into the DRAM tier under `keys`; returns once they are committed.
    pub fn offload(
        &mut self,
        buffer: GpuBuffer,
        ns: u32,
        keys: &[Key],
        page_ids: &[u64],
    ) -> Result<Vec<PutStatus>> {
        match self.call(Op::Offload(page_move(buffer, ns, keys, page_ids)))? {
            Reply::Offloaded { results } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Copies blocks into GPU pages; returns once every copy has completed.
    pub fn onload(
        &mut self,
        buffer: GpuBuffer,
        ns: u32,
        keys: &[Key],
        page_ids: &[u64],
    ) -> Result<Vec<OnloadStatus>> {
        match self.call(Op::Onload(page_move(buffer, ns, keys, page_ids)))? {
            Reply::Onloaded { results, .. } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Starts an onload; finish it with [`Client::onload_wait`] or [`Client::onload_cancel`].
    pub fn onload_async(
        &mut self,
        buffer: GpuBuffer,
        ns: u32,
        keys: &[Key],
        page_ids: &[u64],
    ) -> Result<u64> {
        match self.call(Op::OnloadAsync(page_move(buffer, ns, keys, page_ids)))? {
            Reply::OnloadStarted { ticket } => Ok(ticket),
            r => Err(unexpected(&r)),
        }
    }

    /// Starts an onload whose missing keys are pulled from the peer `hint` names (the JSON of
    /// a hinted `Get`); each page is copied into the GPU as soon as its block has landed.
    /// Finish it with [`Client::onload_pulled_wait`] (which also gives the pull's report) or
    /// [`Client::onload_cancel`].
    pub fn onload_pulled_async(
        &mut self,
        buffer: GpuBuffer,
        ns: u32,
        keys: &[Key],
        page_ids: &[u64],
        hint: &str,
        deadline_ms: Option<u64>,
    ) -> Result<u64> {
        let m = PageMove {
            hint: Some(hint.to_owned()),
            deadline_ms,
            ..page_move(buffer, ns, keys, page_ids)
        };
        match self.call(Op::OnloadAsync(m))? {
            Reply::OnloadStarted { ticket } => Ok(ticket),
            r => Err(unexpected(&r)),
        }
    }

    /// Waits for a started onload: per-key statuses and, for a hinted one, the pull's report.
    pub fn onload_pulled_wait(
        &mut self,
        ticket: u64,
    ) -> Result<(Vec<OnloadStatus>, Option<Box<OpReport>>)> {
        match self.call(Op::OnloadWait { ticket })? {
            Reply::Onloaded { results, pull } => Ok((results, pull)),
            r => Err(unexpected(&r)),
        }
    }

    /// Starts a layer-wise onload: every page's layer 0 first, then layer 1, … (each block is
    /// `layers` equal runs). Wait per layer with [`Client::onload_layer_wait`], then finish it
    /// with [`Client::onload_wait`] or [`Client::onload_cancel`].
    pub fn onload_layers_async(
        &mut self,
        buffer: GpuBuffer,
        ns: u32,
        keys: &[Key],
        page_ids: &[u64],
        layers: u32,
    ) -> Result<u64> {
        let m = PageMove {
            layers,
            ..page_move(buffer, ns, keys, page_ids)
        };
        match self.call(Op::OnloadAsync(m))? {
            Reply::OnloadStarted { ticket } => Ok(ticket),
            r => Err(unexpected(&r)),
        }
    }

    /// Waits until `layer` of a layer-wise onload is in every page; `false` if the onload
    /// stopped first (cancelled or failed).
    pub fn onload_layer_wait(&mut self, ticket: u64, layer: u32) -> Result<bool> {
        match self.call(Op::OnloadLayerWait { ticket, layer })? {
            Reply::LayerLoaded { complete, .. } => Ok(complete),
            r => Err(unexpected(&r)),
        }
    }

    /// Waits for a started onload.
    pub fn onload_wait(&mut self, ticket: u64) -> Result<Vec<OnloadStatus>> {
        match self.call(Op::OnloadWait { ticket })? {
            Reply::Onloaded { results, .. } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Cancels a started onload. When this returns the daemon writes none of its pages again;
    /// keys marked `Loaded` were fully written, `Cancelled` ones not at all.
    pub fn onload_cancel(&mut self, ticket: u64) -> Result<Vec<OnloadStatus>> {
        match self.call(Op::OnloadCancel { ticket })? {
            Reply::Onloaded { results, .. } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Registers this client's arena mapping with CUDA (see [`crate::ArenaMap::register_cuda`]),
    /// using the daemon's piece size.
    pub fn register_arena_cuda(&mut self) -> Result<HostRegistration> {
        let piece = self.stats()?.gpu.register_piece_bytes;
        let piece = if piece == 0 { 1 << 30 } else { piece };
        Ok(self.arena().register_cuda(piece)?)
    }
}
