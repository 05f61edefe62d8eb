//! GPU copies in flight and the leases of the blocks they read: one guard for every onload
//! (a plain one, gpu_conn.rs, and each run of a hinted one, gpu_pulled.rs).

use kvnode_gpu::{CopyTicket, GpuError};
use tokio::sync::watch;

use crate::store::Lease;

/// Copies submitted to a GPU worker and the leases of the blocks they read: the one owner of
/// the rule that a leased block outlives every DMA reading it. [`InFlight::wait`] waits for
/// the copies, then releases the leases. Dropped without waiting (a connection task aborted
/// mid-copy), it cancels what was not issued yet and keeps the leases for the daemon's life
/// rather than risk a slot being reused under a DMA.
#[derive(Debug)]
pub(super) struct InFlight {
    ticket: Option<CopyTicket>,
    leases: Vec<Lease>,
}

impl InFlight {
    pub fn new(ticket: CopyTicket, leases: Vec<Lease>) -> Self {
        Self {
            ticket: Some(ticket),
            leases,
        }
    }

    /// Leading copies completed so far (closed once the copies ended).
    pub fn progress(&self) -> watch::Receiver<usize> {
        self.ticket
            .as_ref()
            .map_or_else(|| watch::channel(0).1, CopyTicket::progress)
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

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.leases.is_empty() {
            self.cancel();
            tracing::warn!(
                blocks = self.leases.len(),
                "GPU onload abandoned mid-copy: its blocks stay leased"
            );
            std::mem::forget(std::mem::take(&mut self.leases));
        }
    }
}
