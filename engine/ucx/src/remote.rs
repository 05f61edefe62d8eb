//! An endpoint to another process's worker, with its remote key: one-sided GETs.

use std::collections::VecDeque;
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

const INPROGRESS: sys::ucs_status_t = sys::ucs_status_t::UCS_INPROGRESS;

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
    /// GETs posted and not yet reported, oldest first: (tag, request; null when it
    /// completed in place).
    flights: VecDeque<(u64, sys::ucs_status_ptr_t)>,
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
            flights: VecDeque::new(),
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
    /// Only with no other GET in flight ([`Remote::post_get`]).
    pub fn get(&mut self, dst: &mut [u8], remote: u64, limit: Duration) -> Result<(), UcxError> {
        if !self.flights.is_empty() {
            return Err(UcxError::Invalid(
                "a blocking GET with GETs in flight".into(),
            ));
        }
        let len = dst.len();
        // SAFETY: dst is exclusively borrowed until the GET lands or is given back below;
        // if UCX keeps it (Stuck) the caller is told never to reuse it.
        unsafe { self.post_get(dst.as_mut_ptr(), len, remote, 0) }?;
        if let Some((_, r)) = self.land_one(limit) {
            return r;
        }
        if self.abandon(limit).is_empty() {
            Err(UcxError::Timeout { len, limit })
        } else {
            Err(UcxError::Stuck { len, limit })
        }
    }

    /// Starts a GET of `len` bytes at the peer's `remote` address into `dst`, known by
    /// `tag` until [`Remote::land_one`] reports it. Several may be in flight at once.
    ///
    /// # Safety
    /// `dst..dst + len` must stay valid and untouched by anyone else until the GET is
    /// reported by [`Remote::land_one`], or returned by [`Remote::abandon`] as given back;
    /// a GET [`Remote::abandon`] lists as kept by UCX may write it at any later time.
    pub unsafe fn post_get(
        &mut self,
        dst: *mut u8,
        len: usize,
        remote: u64,
        tag: u64,
    ) -> Result<(), UcxError> {
        if let Some(why) = self.failed() {
            return Err(UcxError::Closed(why));
        }
        if self.ep.is_null() {
            return Err(UcxError::Closed("closed after an earlier timeout".into()));
        }
        let mut param = sys::ucp_request_param_t::default();
        if self.local.contains(dst as u64, len) {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = self.local.memh();
        }
        // SAFETY: the caller keeps dst valid until the GET completes or is given back;
        // ep and rkey are live.
        let req = unsafe {
            sys::ucp_get_nbx(
                self.ep,
                dst.cast(),
                len,
                remote,
                self.rkey,
                &raw const param,
            )
        };
        if let Some(st) = ptr_status(req) {
            return Err(UcxError::call("ucp_get_nbx", st));
        }
        // A null request completed in place.
        self.flights.push_back((tag, req));
        Ok(())
    }

    /// Tests only (attacks): writes `src` at the peer's `remote` address with one PUT and
    /// waits up to `limit` for it to complete locally. kvnode itself never writes a peer's
    /// memory; the attack tests use this to show a key or address they saw is worthless.
    #[cfg(feature = "test-seams")]
    pub fn put(&mut self, src: &[u8], remote: u64, limit: Duration) -> Result<(), UcxError> {
        if !self.flights.is_empty() {
            return Err(UcxError::Invalid("a PUT with GETs in flight".into()));
        }
        if let Some(why) = self.failed() {
            return Err(UcxError::Closed(why));
        }
        let param = sys::ucp_request_param_t::default();
        // SAFETY: src is borrowed until the PUT is reported or abandoned below; ep and rkey
        // are live.
        let req = unsafe {
            sys::ucp_put_nbx(
                self.ep,
                src.as_ptr().cast(),
                src.len(),
                remote,
                self.rkey,
                &raw const param,
            )
        };
        if let Some(st) = ptr_status(req) {
            return Err(UcxError::call("ucp_put_nbx", st));
        }
        self.flights.push_back((0, req));
        if let Some((_, r)) = self.land_one(limit) {
            r
        } else {
            let _ = self.abandon(limit);
            Err(UcxError::Timeout {
                len: src.len(),
                limit,
            })
        }
    }

    /// GETs posted and not yet reported by [`Remote::land_one`] (or abandoned).
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Progresses until some GET in flight has finished (the oldest finished one is taken)
    /// and returns its tag and outcome; `None` if none has within `limit` (or none is in
    /// flight). A reported GET no longer writes its buffer.
    pub fn land_one(&mut self, limit: Duration) -> Option<(u64, Result<(), UcxError>)> {
        let finished = |req: sys::ucs_status_ptr_t| {
            // SAFETY: a live request handle of this worker (freed only when reported).
            req.is_null() || unsafe { sys::ucp_request_check_status(req) } != INPROGRESS
        };
        let flights = &self.flights;
        if flights.is_empty()
            || !self
                .worker
                .wait_until(limit, || flights.iter().any(|f| finished(f.1)))
        {
            return None;
        }
        let at = self.flights.iter().position(|f| finished(f.1))?;
        let (tag, req) = self.flights.remove(at)?;
        if req.is_null() {
            return Some((tag, Ok(())));
        }
        // SAFETY: finished; read, then freed once and never touched again.
        let st = unsafe {
            let st = sys::ucp_request_check_status(req);
            sys::ucp_request_free(req);
            st
        };
        let r = match check("ucp_get_nbx completion", st) {
            Err(e) if self.failed().is_some() => Err(UcxError::Closed(e.to_string())),
            r => r,
        };
        Some((tag, r))
    }

    /// Cancels every GET in flight, closes the endpoint (flushing nothing: later GETs fail)
    /// and waits up to `limit` for UCX to hand each back. Returns the tags of those it did
    /// not: they are released to UCX, which frees them when they complete, and their
    /// buffers may still be written (never reuse them). The others' buffers are quiet.
    pub fn abandon(&mut self, limit: Duration) -> Vec<u64> {
        for &(_, req) in &self.flights {
            if !req.is_null() {
                // SAFETY: req is live and belongs to this worker.
                unsafe { sys::ucp_request_cancel(self.worker.h, req) };
            }
        }
        self.close(true);
        let live = |req: sys::ucs_status_ptr_t| {
            // SAFETY: live until freed below.
            !req.is_null() && unsafe { sys::ucp_request_check_status(req) } == INPROGRESS
        };
        let flights = &self.flights;
        let _ = self
            .worker
            .wait_until(limit, || !flights.iter().any(|f| live(f.1)));
        let mut kept = Vec::new();
        for (tag, req) in std::mem::take(&mut self.flights) {
            if live(req) {
                kept.push(tag);
            }
            if !req.is_null() {
                // SAFETY: freed once and never touched again; an unfinished one is
                // released to UCX (a worker must not be destroyed holding requests).
                unsafe { sys::ucp_request_free(req) };
            }
        }
        kept
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
        if !self.flights.is_empty() {
            // Not reached by kvnode's own use (it lands or abandons every GET first).
            let _ = self.abandon(CLOSE_LIMIT);
        }
        let force = self.failed().is_some();
        self.close(force);
    }
}
