//! A worker driven by its own thread: the side whose memory peers read.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::context::Context;
use crate::error::UcxError;
use crate::sys;
use crate::worker::{Worker, WorkerAddress};

/// Longest sleep between checks of the stop flag (the stop also signals the worker).
const NAP: Duration = Duration::from_secs(1);

/// A worker that a dedicated thread keeps progressing: it arms the worker and sleeps on
/// its event fd whenever there is nothing to do, so an idle daemon costs no CPU. Over UCX's
/// TCP transport (and its other emulated ones) a peer's GET is served by this worker, so
/// it must run for as long as peers may read; on verbs the NIC serves GETs and this thread
/// only handles connection set-up. Stopped and joined on drop.
#[derive(Debug)]
pub struct Progress {
    stop: Arc<AtomicBool>,
    /// The worker handle, only for `ucp_worker_signal` (thread-safe) while the thread runs.
    signal: usize,
    thread: Option<JoinHandle<Worker>>,
    address: WorkerAddress,
}

impl Progress {
    /// A new worker of `ctx` and the thread (named `name`) that drives it.
    pub fn start(ctx: &Context, name: &str) -> Result<Self, UcxError> {
        let mut worker = Worker::new(ctx)?;
        let address = worker.address()?;
        let signal = worker.h as usize;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                while !flag.load(Ordering::Acquire) {
                    if worker.wait(NAP).is_err() {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                worker
            })
            .map_err(|e| UcxError::Invalid(format!("cannot start the progress thread: {e}")))?;
        Ok(Self {
            stop,
            signal,
            thread: Some(thread),
            address,
        })
    }

    /// The worker's address, for peers to connect to.
    pub fn address(&self) -> &WorkerAddress {
        &self.address
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: the thread gives the worker back only after it sees `stop`, and the
        // worker is destroyed only below, after the join; ucp_worker_signal is thread-safe.
        unsafe { sys::ucp_worker_signal(self.signal as sys::ucp_worker_h) };
        if let Some(t) = self.thread.take() {
            // The worker (and its endpoints to peers) is destroyed here.
            drop(t.join());
        }
    }
}
