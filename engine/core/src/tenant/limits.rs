//! Per-uid caps on what a client identity may hold (`[tenants.limits]`, and a tenant's own
//! `[tenants.tenant.limits]`): connections, attached regions (client memfds and GPU buffers,
//! each a descriptor or a mapping in the daemon) and leased blocks (each costs heap until
//! released). In force with or without a tenant map: without one every client is tenant
//! `default`, and the caps still hold per uid, so one uid cannot starve another.
//!
//! The descriptor caps default to a fraction of the daemon's descriptor limit (raised to its
//! hard limit at start), so one uid at its caps holds at most ~19 % of the descriptors.

use serde::{Deserialize, Serialize};

/// Default `connections_per_uid`, when the descriptor limit allows it.
pub const DEFAULT_CONNECTIONS: u32 = 256;
/// Default `regions_per_uid`, when the descriptor limit allows it.
pub const DEFAULT_REGIONS: u32 = 1024;
/// Default `leased_blocks_per_uid` (about 110 bytes of daemon heap each: 1 Mi leases of one
/// block grew a daemon by 94-117 MiB).
pub const DEFAULT_LEASED_BLOCKS: u64 = 1 << 20;
/// One uid's descriptor caps together may take at most 1/this of the descriptor limit.
pub const FD_SHARE: u64 = 2;

/// `[tenants.limits]` (per uid, every tenant) or a tenant's `limits` table (per uid of that
/// tenant; a field it leaves out comes from `[tenants.limits]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientLimits {
    /// Client connections one uid may have open (from accept to close); the next is
    /// refused at accept with `Error { LimitReached }`. Default: 256, or the descriptor
    /// limit / 16 when that is lower.
    pub connections_per_uid: Option<u32>,
    /// Regions (`AttachRegion` memfds) and GPU buffers (`AttachGpu`) one uid may have
    /// attached over all its connections (each holds a descriptor or a mapping); the next
    /// attach is refused `LimitReached`. A connection holds at most 16 regions whatever
    /// this says. Default: 1024, or the descriptor limit / 8 when that is lower.
    pub regions_per_uid: Option<u32>,
    /// Blocks one uid may hold leased over all its connections (lease-mode gets until
    /// `Release`, async GPU onloads until waited); a holding request that would pass it is
    /// refused `LimitReached` before anything is leased. Default: 1048576.
    pub leased_blocks_per_uid: Option<u64>,
}

/// The caps in force for one tenant's uids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Connections per uid.
    pub connections: u32,
    /// Regions and GPU buffers per uid.
    pub regions: u32,
    /// Leased blocks per uid.
    pub leased_blocks: u64,
}

/// Caps that would let one uid starve the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// A cap of zero.
    #[error("{scope}: {field} = 0 would refuse every client: remove it or give at least 1")]
    Zero {
        /// `[tenants.limits]` or the tenant.
        scope: String,
        /// The field.
        field: &'static str,
    },
    /// One uid's descriptor caps together pass half the descriptor limit.
    #[error(
        "{scope}: connections_per_uid ({connections}) + regions_per_uid ({regions}) descriptors for one uid exceed half the daemon's descriptor limit ({nofile}): one uid could starve the others; lower them or raise the hard RLIMIT_NOFILE (LimitNOFILE= in the unit)"
    )]
    TooManyDescriptors {
        /// `[tenants.limits]` or the tenant.
        scope: String,
        /// Connections per uid.
        connections: u32,
        /// Regions per uid.
        regions: u32,
        /// The hard descriptor limit.
        nofile: u64,
    },
}

/// The daemon's hard descriptor limit (the soft one is raised to it at start).
pub fn fd_hard_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut r) } != 0 {
        return 1024;
    }
    r.rlim_max
}

impl ClientLimits {
    /// `self`, with each field left out taken from `base`.
    #[must_use]
    pub fn or(self, base: Self) -> Self {
        Self {
            connections_per_uid: self.connections_per_uid.or(base.connections_per_uid),
            regions_per_uid: self.regions_per_uid.or(base.regions_per_uid),
            leased_blocks_per_uid: self.leased_blocks_per_uid.or(base.leased_blocks_per_uid),
        }
    }

    /// The caps in force under a descriptor limit of `nofile`.
    pub fn caps(&self, nofile: u64) -> Caps {
        let share =
            |d: u32, part: u64| u32::try_from(nofile / part).unwrap_or(u32::MAX).clamp(1, d);
        Caps {
            connections: self
                .connections_per_uid
                .unwrap_or_else(|| share(DEFAULT_CONNECTIONS, 16)),
            regions: self
                .regions_per_uid
                .unwrap_or_else(|| share(DEFAULT_REGIONS, 8)),
            leased_blocks: self.leased_blocks_per_uid.unwrap_or(DEFAULT_LEASED_BLOCKS),
        }
    }

    /// Checks the caps of `scope` under a descriptor limit of `nofile`.
    pub fn validate(&self, scope: &str, nofile: u64) -> Result<(), LimitsError> {
        for (field, zero) in [
            ("connections_per_uid", self.connections_per_uid == Some(0)),
            ("regions_per_uid", self.regions_per_uid == Some(0)),
            (
                "leased_blocks_per_uid",
                self.leased_blocks_per_uid == Some(0),
            ),
        ] {
            if zero {
                let scope = scope.to_owned();
                return Err(LimitsError::Zero { scope, field });
            }
        }
        let c = self.caps(nofile);
        if u64::from(c.connections) + u64::from(c.regions) > nofile / FD_SHARE {
            return Err(LimitsError::TooManyDescriptors {
                scope: scope.to_owned(),
                connections: c.connections,
                regions: c.regions,
                nofile,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_stay_well_below_the_descriptor_limit() {
        for nofile in [64, 1024, 4096, 20_000, 1 << 20] {
            let c = ClientLimits::default().caps(nofile);
            let fds = u64::from(c.connections) + u64::from(c.regions);
            assert!(fds * 5 <= nofile.max(5 * 2), "{nofile}: {c:?}");
            ClientLimits::default().validate("t", nofile).unwrap();
        }
        let c = ClientLimits::default().caps(1 << 20);
        assert_eq!((c.connections, c.regions), (256, 1024));
        assert_eq!(c.leased_blocks, DEFAULT_LEASED_BLOCKS);
    }

    #[test]
    fn a_tenant_overrides_only_what_it_names() {
        let base = ClientLimits {
            connections_per_uid: Some(10),
            regions_per_uid: Some(20),
            leased_blocks_per_uid: None,
        };
        let own = ClientLimits {
            regions_per_uid: Some(5),
            ..ClientLimits::default()
        };
        let c = own.or(base).caps(1 << 20);
        assert_eq!((c.connections, c.regions), (10, 5));
        assert_eq!(c.leased_blocks, DEFAULT_LEASED_BLOCKS);
    }

    #[test]
    fn caps_that_could_starve_other_uids_are_refused_with_what_to_change() {
        let big = ClientLimits {
            connections_per_uid: Some(400),
            regions_per_uid: Some(200),
            ..ClientLimits::default()
        };
        let e = big.validate("[tenants.limits]", 1024).unwrap_err();
        assert!(
            e.to_string().contains("raise the hard RLIMIT_NOFILE"),
            "{e}"
        );
        let zero = ClientLimits {
            leased_blocks_per_uid: Some(0),
            ..ClientLimits::default()
        };
        let e = zero.validate("tenant \"a\"", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("leased_blocks_per_uid = 0"), "{e}");
    }
}
