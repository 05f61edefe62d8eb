//! The UCP context: one per daemon, shared by its workers and memory registrations.

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::sync::Arc;

use crate::error::{UcxError, check};
use crate::sys;

/// The raw context; cleaned up when the last owner (context, worker, region) drops.
#[derive(Debug)]
pub(crate) struct Ctx(pub(crate) sys::ucp_context_h);

// SAFETY: the context is created with `mt_workers_shared`, so UCP serializes context-level
// calls (memory mapping, worker creation) made from several threads.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: every worker and region holds an Arc of this, so none outlives it.
        unsafe { sys::ucp_cleanup(self.0) };
    }
}

/// A UCP context with the RMA and WAKEUP features.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) ctx: Arc<Ctx>,
}

impl Context {
    /// Initializes UCP, reading the `UCX_*` environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).
    pub fn new() -> Result<Self, UcxError> {
        Self::with_settings(&[])
    }

    /// As [`Context::new`], then each `(NAME, value)` of `settings` overrides the
    /// environment's `UCX_NAME` (e.g. `("TLS", "tcp")`).
    pub fn with_settings(settings: &[(&str, &str)]) -> Result<Self, UcxError> {
        let mut cfg: *mut sys::ucp_config_t = null_mut();
        // SAFETY: out-pointer to a local; NULL env prefix and file mean "UCX_" and none.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(null(), null(), &raw mut cfg)
        })?;
        for (name, value) in settings {
            let bad = |_| UcxError::Invalid(format!("UCX setting {name}={value} holds a NUL"));
            let (n, v) = (
                CString::new(*name).map_err(bad)?,
                CString::new(*value).map_err(bad)?,
            );
            // SAFETY: cfg is live; both strings are NUL-terminated and read during the call.
            let st = unsafe { sys::ucp_config_modify(cfg, n.as_ptr(), v.as_ptr()) };
            if let Err(e) = check("ucp_config_modify", st) {
                // SAFETY: released once.
                unsafe { sys::ucp_config_release(cfg) };
                return Err(e);
            }
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(
                sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            ),
            features: u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP),
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut h: sys::ucp_context_h = null_mut();
        // SAFETY: params and cfg are valid; the API version is the one the declarations
        // were generated from.
        let st = unsafe {
            sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &raw const params,
                cfg,
                &raw mut h,
            )
        };
        // SAFETY: cfg came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(cfg) };
        check("ucp_init", st)?;
        Ok(Self {
            ctx: Arc::new(Ctx(h)),
        })
    }

    /// The UCX library version in use (`ucp_get_version_string`), e.g. "1.13.1".
    pub fn version() -> String {
        // SAFETY: returns a static string.
        unsafe { CStr::from_ptr(sys::ucp_get_version_string()) }
            .to_string_lossy()
            .into_owned()
    }
}
