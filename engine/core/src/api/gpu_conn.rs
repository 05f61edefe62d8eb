//! GPU state owned by one connection: attached IPC buffers and pending onloads.

use std::collections::HashMap;
use std::sync::Arc;

use kvnode_gpu::{DeviceWorker, GpuError};
use kvnode_proto::gpu::{GpuLayout, OnloadStatus};
use tokio::sync::watch;

use super::gpu_copies::InFlight;
use super::gpu_pulled::PulledOnload;

/// A mapped buffer.
#[derive(Debug)]
pub(super) struct Attached {
    pub worker: Arc<DeviceWorker>,
    pub dev: u64,
    pub layout: GpuLayout,
    /// Its place under the uid's `regions_per_uid`.
    pub _charge: crate::tenant::Charge,
}

/// An onload whose copies were submitted; its leases are released only by
/// [`PendingOnload::wait`], once every copy has completed ([`InFlight`]).
#[derive(Debug)]
pub(super) struct PendingOnload {
    copies: InFlight,
    pub results: Vec<OnloadStatus>,
    /// Per key: index one past its last copy, for keys whose copies were submitted.
    pub ends: Vec<Option<usize>>,
    pub bytes_per_page: u64,
    /// Layer-wise onloads: per layer, the index one past its last copy (empty otherwise).
    pub layer_ends: Vec<usize>,
    /// Leading copies completed so far (closed once the copies ended).
    pub progress: watch::Receiver<usize>,
    /// When the copies were submitted (the DRAM → GPU path's cost).
    pub started: std::time::Instant,
}

impl PendingOnload {
    pub fn new(
        copies: InFlight,
        results: Vec<OnloadStatus>,
        ends: Vec<Option<usize>>,
        bytes_per_page: u64,
    ) -> Self {
        Self {
            progress: copies.progress(),
            copies,
            results,
            ends,
            bytes_per_page,
            layer_ends: Vec::new(),
            started: std::time::Instant::now(),
        }
    }

    /// Measures the DRAM → GPU path from this onload's copies: a task follows its progress
    /// and, when the copies end, records the pages they landed and the time since submission
    /// (not the time until the client asks: that would count the engine's own work).
    pub fn measure(self, metrics: std::sync::Arc<crate::obs::Metrics>) -> Self {
        let mut progress = self.progress.clone();
        let (ends, page, started) = (self.ends.clone(), self.bytes_per_page, self.started);
        tokio::spawn(async move {
            while progress.changed().await.is_ok() {}
            let done = *progress.borrow();
            let pages = ends.iter().flatten().filter(|&&e| e <= done).count() as u64;
            let took = started.elapsed();
            metrics
                .costs
                .record_hot(crate::obs::cost::DRAM_GPU, pages * page, took);
        });
        self
    }

    /// Marks the onload layer-wise, with its layers' copy boundaries.
    pub fn layered(mut self, layer_ends: Vec<usize>) -> Self {
        self.layer_ends = layer_ends;
        self
    }

    /// Stops issuing copies; those already issued still complete.
    pub fn cancel(&self) {
        self.copies.cancel();
    }

    /// Waits for every issued copy, then releases the leases; returns how many copies ran.
    pub async fn wait(&mut self) -> Result<usize, GpuError> {
        self.copies.wait().await
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
