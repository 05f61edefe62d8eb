//! Workers: UCP progress engines with an event fd.

use std::fmt;
use std::os::fd::RawFd;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::context::{Context, Ctx};
use crate::error::{UcxError, check};
use crate::sys;

/// A worker's address (`ucp_worker_get_address`): what a peer needs to open an endpoint to
/// it. Sent only over an authenticated connection and never logged (`Debug` prints its
/// length only).
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerAddress(pub Vec<u8>);

impl fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerAddress(<{} bytes>)", self.0.len())
    }
}

/// A UCP worker in serialized thread mode: one thread at a time uses it (it may move
/// between threads), which `&mut`/`Send` without `Sync` enforce.
#[derive(Debug)]
pub struct Worker {
    _ctx: Arc<Ctx>,
    pub(crate) h: sys::ucp_worker_h,
    efd: RawFd,
}

// SAFETY: created with UCS_THREAD_MODE_SERIALIZED: any one thread at a time may use it.
unsafe impl Send for Worker {}

impl Worker {
    /// A new worker of `ctx`.
    pub fn new(ctx: &Context) -> Result<Self, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = null_mut();
        // SAFETY: valid params, out-pointer to a local.
        check("ucp_worker_create", unsafe {
            sys::ucp_worker_create(ctx.ctx.0, &raw const params, &raw mut h)
        })?;
        let mut efd: RawFd = -1;
        // SAFETY: h is live; out-pointer to a local.
        let st = unsafe { sys::ucp_worker_get_efd(h, &raw mut efd) };
        if let Err(e) = check("ucp_worker_get_efd", st) {
            // SAFETY: created above, destroyed once.
            unsafe { sys::ucp_worker_destroy(h) };
            return Err(e);
        }
        Ok(Self {
            _ctx: Arc::clone(&ctx.ctx),
            h,
            efd,
        })
    }

    /// This worker's address, for peers to connect to.
    pub fn address(&self) -> Result<WorkerAddress, UcxError> {
        let mut a: *mut sys::ucp_address_t = null_mut();
        let mut len = 0usize;
        // SAFETY: out-pointers to locals.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.h, &raw mut a, &raw mut len)
        })?;
        // SAFETY: UCP returned `len` bytes at `a`, released right after the copy.
        let v = unsafe { std::slice::from_raw_parts(a.cast::<u8>(), len) }.to_vec();
        // SAFETY: a came from ucp_worker_get_address of this worker.
        unsafe { sys::ucp_worker_release_address(self.h, a) };
        Ok(WorkerAddress(v))
    }

    /// One round of progress; the number of events it handled.
    pub fn progress(&mut self) -> u32 {
        // SAFETY: `&mut self`: this thread is the worker's only user now.
        unsafe { sys::ucp_worker_progress(self.h) }
    }

    /// Progresses until idle, then sleeps on the event fd until something arrives or `limit`
    /// passes (also woken by [`crate::Progress`]'s stop signal).
    pub fn wait(&mut self, limit: Duration) -> Result<(), UcxError> {
        while self.progress() != 0 {}
        // SAFETY: as in `progress`.
        let st = unsafe { sys::ucp_worker_arm(self.h) };
        if st == sys::ucs_status_t::UCS_ERR_BUSY {
            return Ok(()); // events arrived meanwhile: progress again
        }
        check("ucp_worker_arm", st)?;
        let mut p = libc::pollfd {
            fd: self.efd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one pollfd on the stack; EINTR is just an early return.
        unsafe { libc::poll(&raw mut p, 1, ms) };
        Ok(())
    }

    /// Waits until `done()` holds, progressing; `false` if `limit` passed first.
    pub(crate) fn wait_until(&mut self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let end = Instant::now() + limit;
        loop {
            // Spin a little first: a GET's completion usually follows its request closely,
            // and arming the fd for every block costs a system call or two.
            for _ in 0..64 {
                self.progress();
                if done() {
                    return true;
                }
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            if self.wait(left.min(Duration::from_millis(50))).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once; its endpoints (Remote) own the worker, so
        // they are closed before this runs.
        unsafe { sys::ucp_worker_destroy(self.h) };
    }
}
