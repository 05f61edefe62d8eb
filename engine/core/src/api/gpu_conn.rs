//! GPU state owned by one connection: attached IPC buffers and pending onloads.

use std::collections::HashMap;
use std::sync::Arc;

use kvnode_gpu::{CopyTicket, DeviceWorker, GpuError};
use kvnode_proto::gpu::{GpuLayout, OnloadStatus};
use tokio::sync::watch;

use super::gpu_pulled::PulledOnload;
use crate::store::Lease;

/// A mapped buffer.
#[derive(Debug)]
pub(super) struct Attached {
    pub worker: Arc<DeviceWorker>,
    pub dev: u64,
    pub layout: GpuLayout,
    /// Its place under the uid's `regions_per_uid`.
    pub _charge: crate::tenant::Charge,
}

/// An onload whose copies were submitted. Its leases must outlive the copies: they are
/// released only by [`PendingOnload::wait`], once every copy has completed.
#[derive(Debug)]
pub(super) struct PendingOnload {
    ticket: Option<CopyTicket>,
    leases: Vec<Lease>,
    pub results: Vec<OnloadStatus>,
    /// Per key: index one past its last copy, for keys whose copies were submitted.
    pub ends: Vec<Option<usize>>,
    pub bytes_per_page: u64,
    /// Layer-wise onloads: per layer, the index one past its last copy (empty otherwise).
    pub layer_ends: Vec<usize>,
    /// Leading copies completed so far (closed once the copies ended).
    pub progress: watch::Receiver<usize>,
}

impl PendingOnload {
    pub fn new(
        ticket: CopyTicket,
        leases: Vec<Lease>,
        results: Vec<OnloadStatus>,
        ends: Vec<Option<usize>>,
        bytes_per_page: u64,
    ) -> Self {
        Self {
            progress: ticket.progress(),
            ticket: Some(ticket),
            leases,
            results,
            ends,
            bytes_per_page,
            layer_ends: Vec::new(),
        }
    }

    /// Marks the onload layer-wise, with its layers' copy boundaries.
    pub fn layered(mut self, layer_ends: Vec<usize>) -> Self {
        self.layer_ends = layer_ends;
        self
    }

    /// Stops issuing copies; those already issued still complete.
    pub fn cancel(&self) {
        if let Some(t) = &self.ticket {
            t.cancel();
        }
    }

    /// Waits for every issued copy, then releases the leases; returns how many copies ran.
    pub async fn wait(&mut self) -> Result<usize, GpuError> {
        let done = match self.ticket.take() {
            Some(t) => t.wait().await,
            None => Ok(0),
        };
        self.leases.clear();
        done
    }
}

impl Drop for PendingOnload {
    fn drop(&mut self) {
        if !self.leases.is_empty() {
            // Dropped without waiting (the connection task was aborted): copies may still
            // read these blocks, so their leases are kept for the daemon's life rather
            // than risk a slot being reused under a DMA.
            self.cancel();
            tracing::warn!(
                blocks = self.leases.len(),
                "GPU onload abandoned mid-copy: its blocks stay leased"
            );
            std::mem::forget(std::mem::take(&mut self.leases));
        }
    }
}

/// A started onload: copies from blocks held here, or a hinted one that streams pulled pages.
#[derive(Debug)]
pub(super) enum Onload {
    Copies(PendingOnload),
    Pulled(PulledOnload),
}

impl Onload {
    /// Stops issuing copies (and a hinted onload's pull); those issued still complete.
    pub fn cancel(&self) {
        match self {
            Self::Copies(p) => p.cancel(),
            Self::Pulled(p) => p.cancel(),
        }
    }
}

/// GPU state owned by one connection.
#[derive(Debug, Default)]
pub(super) struct GpuConn {
    pub buffers: Vec<Attached>,
    pub onloads: HashMap<u64, Onload>,
    /// Per async onload ticket: its keys under the uid's `leased_blocks_per_uid`, removed
    /// with the onload.
    pub charges: HashMap<u64, crate::tenant::Charge>,
}
