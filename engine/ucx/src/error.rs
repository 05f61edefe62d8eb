//! UCX failures as typed errors.

use std::ffi::CStr;
use std::time::Duration;

use crate::sys;

/// A failed UCX call or a GET that did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UcxError {
    /// A UCX call returned an error status.
    #[error("UCX {call} failed: {text} ({code})")]
    Call {
        /// The UCX function.
        call: &'static str,
        /// `ucs_status_t` value.
        code: i8,
        /// `ucs_status_string`.
        text: String,
    },
    /// A GET did not complete within its limit; it was cancelled and its endpoint closed.
    #[error("UCX GET of {len} bytes did not complete within {limit:?}: cancelled")]
    Timeout {
        /// Bytes asked for.
        len: usize,
        /// The limit.
        limit: Duration,
    },
    /// A GET timed out and even the cancel did not complete within its limit: the caller
    /// must not reuse the destination memory (UCX may still write it).
    #[error("UCX GET of {len} bytes neither completed nor cancelled within {limit:?}")]
    Stuck {
        /// Bytes asked for.
        len: usize,
        /// The limit given to the cancel.
        limit: Duration,
    },
    /// The endpoint failed earlier (the peer died or an op was cancelled on it).
    #[error("UCX endpoint to the peer is closed: {0}")]
    Closed(String),
    /// A caller's argument out of range.
    #[error("UCX: {0}")]
    Invalid(String),
}

impl UcxError {
    pub(crate) fn call(call: &'static str, s: sys::ucs_status_t) -> Self {
        Self::Call {
            call,
            code: s.0,
            text: status_text(s),
        }
    }
}

/// `ucs_status_string` of a status.
pub(crate) fn status_text(s: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static NUL-terminated string for any value.
    unsafe { CStr::from_ptr(sys::ucs_status_string(s)) }
        .to_string_lossy()
        .into_owned()
}

/// `Ok` for `UCS_OK`, else the error of `call`.
pub(crate) fn check(call: &'static str, s: sys::ucs_status_t) -> Result<(), UcxError> {
    if s == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::call(call, s))
    }
}

/// The status a `ucs_status_ptr_t` encodes (`UCS_PTR_IS_ERR`), `None` for a request
/// handle or NULL.
pub(crate) fn ptr_status(p: sys::ucs_status_ptr_t) -> Option<sys::ucs_status_t> {
    let v = p as isize;
    (isize::from(sys::ucs_status_t::UCS_ERR_LAST.0)..0)
        .contains(&v)
        .then_some(sys::ucs_status_t(v as i8))
}
