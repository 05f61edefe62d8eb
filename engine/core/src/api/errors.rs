//! Error replies shared by the handlers.

use kvnode_proto::client::{ErrorCode, Reply};

use crate::dram::TierError;

/// A tier refusal as an error reply.
pub(super) fn tier_error(e: &TierError) -> Reply {
    let code = match e {
        TierError::UnknownNamespace(_) => ErrorCode::UnknownNamespace,
        TierError::SlotTooLarge { .. } | TierError::TooManyClasses(_) | TierError::NoLowerTier => {
            ErrorCode::Unsupported
        }
        TierError::RecoveryBacklog { .. } => ErrorCode::LimitReached,
        _ => ErrorCode::Invalid,
    };
    error(code, e.to_string())
}

/// An `Invalid` reply.
pub(super) fn invalid(msg: impl Into<String>) -> Reply {
    error(ErrorCode::Invalid, msg)
}

/// An error reply.
pub(super) fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}

/// The refusal of a holding get that cannot be leased whole now.
pub(super) fn too_large(leasable: usize, keys: usize, hold_limit: u64) -> Reply {
    Reply::TooLarge {
        leasable: leasable as u32,
        message: format!(
            "only the leading {leasable} of {keys} keys can be leased now (promotions held by one request are limited to {hold_limit} bytes, half the DRAM tier, and DRAM cannot hold more): lease those, use and release them, then ask for the rest"
        ),
    }
}
