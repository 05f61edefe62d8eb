//! An endpoint to another process's worker, with its remote key: one-sided GETs.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Arc;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::Duration;

use crate::context::Context;
use crate::error::{UcxError, check, ptr_status, status_text};
use crate::region::{PackedRkey, Region};
use crate::sys;
use crate::worker::{Worker, WorkerAddress};

/// How long closing an endpoint may wait for its flush.
const CLOSE_LIMIT: Duration = Duration::from_millis(200);

/// Set by UCX when the endpoint fails (peer died, connection reset): the failing status.
extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the Box<AtomicI8> owned by the Remote, which outlives its endpoint.
    let flag = unsafe { &*arg.cast::<AtomicI8>() };
    flag.store(status.0, Ordering::Release);
}

/// A worker of this process, an endpoint from it to a peer's worker, and the peer's
/// unpacked remote key: the reading side of a one-sided transport. Owned by one thread at a
/// time (`Send`, not `Sync`).
#[derive(Debug)]
pub struct Remote {
    rkey: sys::ucp_rkey_h,
    ep: sys::ucp_ep_h,
    /// Opened with UCP_ERR_HANDLING_MODE_PEER (closes may be forced).
    peer_errors: bool,
    failed: Box<AtomicI8>,
    /// Registration of this process's memory that GETs land in (passed as the local memh).
    local: Arc<Region>,
    worker: Worker,
}

// SAFETY: the endpoint and rkey belong to `worker` (serialized mode) and are used only
// through `&mut self`.
unsafe impl Send for Remote {}

impl Remote {
    /// Opens an endpoint (peer error handling on) to `addr` on a new worker of `ctx`, and
    /// unpacks `rkey` for it. GETs land in memory registered as `local`.
    pub fn connect(
        ctx: &Context,
        addr: &WorkerAddress,
        rkey: &PackedRkey,
        local: Arc<Region>,
    ) -> Result<Self, UcxError> {
        let worker = Worker::new(ctx)?;
        let failed = Box::new(AtomicI8::new(0));
        // Peer failure handling first (a dead peer fails requests; closes can be forced).
        // UCX 1.13's shared-memory transports cannot detect peer failure and refuse it as
        // "unreachable": then the endpoint is opened without it (same-node use only).
        let ep = match Self::endpoint(&worker, addr, &failed, true) {
            Err(UcxError::Call { code, .. })
                if code == sys::ucs_status_t::UCS_ERR_UNREACHABLE.0 =>
            {
                Self::endpoint(&worker, addr, &failed, false)?
            }
            r => r?,
        };
        let mut r = Self {
            rkey: null_mut(),
            peer_errors: ep.1,
            ep: ep.0,
            failed,
            local,
            worker,
        };
        let mut k: sys::ucp_rkey_h = null_mut();
        // SAFETY: the packed bytes are read during the call; ep is live.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(r.ep, rkey.0.as_ptr().cast(), &raw mut k)
        })?;
        r.rkey = k;
        Ok(r)
    }

    /// `ucp_ep_create` to `addr`, with peer error handling or without; the endpoint and
    /// whether it has it.
    fn endpoint(
        worker: &Worker,
        addr: &WorkerAddress,
        failed: &AtomicI8,
        peer_errors: bool,
    ) -> Result<(sys::ucp_ep_h, bool), UcxError> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS),
            address: addr.0.as_ptr().cast(),
            ..Default::default()
        };
        if peer_errors {
            params.field_mask |= u64::from(
                sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            );
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = sys::ucp_err_handler {
                cb: Some(on_ep_error),
                arg: (&raw const *failed).cast_mut().cast(),
            };
        }
        let mut ep: sys::ucp_ep_h = null_mut();
        // SAFETY: the address bytes are read during the call; `failed` lives in a Box the
        // Remote keeps until after the endpoint is closed.
        check("ucp_ep_create", unsafe {
            sys::ucp_ep_create(worker.h, &raw const params, &raw mut ep)
        })?;
        Ok((ep, peer_errors))
    }

    /// Whether the endpoint detects peer failure (false on UCX 1.13's shared-memory
    /// transports: then a GET from a frozen peer can end only as [`UcxError::Stuck`]).
    pub fn detects_peer_failure(&self) -> bool {
        self.peer_errors
    }

    /// Whether the endpoint has failed (then every GET fails with [`UcxError::Closed`]).
    pub fn failed(&self) -> Option<String> {
        match self.failed.load(Ordering::Acquire) {
            0 => None,
            s => Some(status_text(sys::ucs_status_t(s))),
        }
    }

    /// Reads `dst.len()` bytes at the peer's `remote` address into `dst` and returns once
    /// they have landed. If they have not within `limit`, the GET is cancelled and the
    /// endpoint closed (a frozen peer costs at most `limit`), and this waits up to `limit`
    /// more for UCX to give the request back: [`UcxError::Timeout`] then means `dst` is no
    /// longer written, [`UcxError::Stuck`] that it may still be (the caller must not reuse it).
    pub fn get(&mut self, dst: &mut [u8], remote: u64, limit: Duration) -> Result<(), UcxError> {
        if let Some(why) = self.failed() {
            return Err(UcxError::Closed(why));
        }
        if self.ep.is_null() {
            return Err(UcxError::Closed("closed after an earlier timeout".into()));
        }
        let mut param = sys::ucp_request_param_t::default();
        if self.local.contains(dst.as_ptr() as u64, dst.len()) {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = self.local.memh();
        }
        // SAFETY: dst is exclusively borrowed until the request completes or is given back
        // (or, if stuck, the caller is told not to reuse it); ep and rkey are live.
        let req = unsafe {
            sys::ucp_get_nbx(
                self.ep,
                dst.as_mut_ptr().cast(),
                dst.len(),
                remote,
                self.rkey,
                &raw const param,
            )
        };
        if req.is_null() {
            return Ok(()); // completed in place
        }
        if let Some(st) = ptr_status(req) {
            return Err(UcxError::call("ucp_get_nbx", st));
        }
        let status = || {
            // SAFETY: req is a live request handle until freed below.
            unsafe { sys::ucp_request_check_status(req) }
        };
        let in_progress = |s: sys::ucs_status_t| s == sys::ucs_status_t::UCS_INPROGRESS;
        if self.worker.wait_until(limit, || !in_progress(status())) {
            let st = status();
            // SAFETY: completed; freed once.
            unsafe { sys::ucp_request_free(req) };
            return match check("ucp_get_nbx completion", st) {
                Err(e) if self.failed().is_some() => Err(UcxError::Closed(e.to_string())),
                r => r,
            };
        }
        // Not landed in time: cancel, close the endpoint (flushing nothing), and wait for
        // UCX to hand the request back so `dst` is known to be quiet.
        // SAFETY: req is live and belongs to this worker.
        unsafe { sys::ucp_request_cancel(self.worker.h, req) };
        self.close(true);
        if self.worker.wait_until(limit, || !in_progress(status())) {
            // SAFETY: completed (cancelled); freed once.
            unsafe { sys::ucp_request_free(req) };
            Err(UcxError::Timeout {
                len: dst.len(),
                limit,
            })
        } else {
            // Released to UCX, which frees it when it completes (a worker must not be
            // destroyed holding unreleased requests); `dst` may still be written until then.
            // SAFETY: req is live; after this call it is never touched again.
            unsafe { sys::ucp_request_free(req) };
            Err(UcxError::Stuck {
                len: dst.len(),
                limit,
            })
        }
    }

    /// Destroys the key and closes the endpoint (`force`: without flushing), waiting a
    /// bounded time for the close to finish.
    fn close(&mut self, force: bool) {
        if !self.rkey.is_null() {
            // SAFETY: unpacked by us, destroyed once, before its endpoint closes.
            unsafe { sys::ucp_rkey_destroy(self.rkey) };
            self.rkey = null_mut();
        }
        if self.ep.is_null() {
            return;
        }
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: ep is live and closed once.
        let req = unsafe { sys::ucp_ep_close_nbx(self.ep, &raw const param) };
        self.ep = null_mut();
        if req.is_null() || ptr_status(req).is_some() {
            return;
        }
        // SAFETY: req is a live close request until freed.
        let status = || unsafe { sys::ucp_request_check_status(req) };
        // Freed whether or not it completed in time: UCX frees an unfinished request when
        // it completes, and a worker must not be destroyed holding unreleased requests.
        let _ = self.worker.wait_until(CLOSE_LIMIT, || {
            status() != sys::ucs_status_t::UCS_INPROGRESS
        });
        // SAFETY: req is live; freed once and never touched again.
        unsafe { sys::ucp_request_free(req) };
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let force = self.failed().is_some();
        self.close(force);
    }
}
