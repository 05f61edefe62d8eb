//! The `[tenants]` section of the config: which client identity (uid, gid from
//! `SO_PEERCRED`) belongs to which tenant, what unmapped identities get, and each tenant's
//! quotas. No tenant listed (the default) means one tenant and today's behaviour.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::limits::{ClientLimits, LimitsError, fd_hard_limit};
use crate::size_serde::{de_opt_size, ser_opt_size};

/// Longest tenant name.
pub const MAX_NAME: usize = 64;

/// The name of the tenant unmapped identities share (with `unmapped = "default"`).
pub const DEFAULT_TENANT: &str = "default";

/// The implicit `default` tenant of a map may hold 1/this of the DRAM tier (see
/// [`TenantsConfig::with_default_quota`]).
pub const DEFAULT_TENANT_DRAM_SHARE: u64 = 4;

/// What happens to a client whose uid and gid no tenant lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unmapped {
    /// It joins the tenant named `default` (which may be listed to give it quotas).
    #[default]
    Default,
    /// It is refused at accept (logged, counted in `kvnode_clients_refused_total`).
    Refuse,
}

/// `[tenants]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantsConfig {
    /// What unmapped identities get. Default: `default` (the shared tenant `default`).
    pub unmapped: Unmapped,
    /// The tenants (`[[tenants.tenant]]`). Default: none, which means one tenant, no
    /// quotas, the client's `tenant_salt` used as given and the arena shared (as before
    /// tenants existed).
    pub tenant: Vec<TenantSettings>,
    /// Per-uid caps on connections, attached regions and leased blocks (`[tenants.limits]`,
    /// in force with or without a map). Default: each cap's own default (limits.rs).
    pub limits: ClientLimits,
}

/// One `[[tenants.tenant]]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantSettings {
    /// Name: 1-64 characters of `A-Z a-z 0-9 _ . -`. Part of every namespace id of the
    /// tenant, so daemons of one cluster must use the same names for pulls to hit.
    pub name: String,
    /// Client uids of this tenant (a uid is checked before any gid).
    pub uids: Vec<u32>,
    /// Client gids (the peer process's effective gid) of this tenant.
    pub gids: Vec<u32>,
    /// Bytes of DRAM blocks the tenant may hold. Default: no limit but the tier.
    #[serde(serialize_with = "ser_opt_size", deserialize_with = "de_opt_size")]
    pub dram_quota: Option<u64>,
    /// Bytes of NVMe blocks the tenant may hold. Default: no limit but the tier.
    #[serde(serialize_with = "ser_opt_size", deserialize_with = "de_opt_size")]
    pub nvme_quota: Option<u64>,
    /// Bytes of its DRAM blocks that `kv.retain` may hold at once. Default: half its DRAM
    /// quota (half the tier without one).
    #[serde(serialize_with = "ser_opt_size", deserialize_with = "de_opt_size")]
    pub retain_quota: Option<u64>,
    /// Hand this tenant's clients the arena memfd (zero-copy lease reads and `Alloc`). The
    /// mapping shows every tenant's blocks, so only a tenant trusted with all of them may
    /// have it. Default: false (inline gets/puts, regions and GPU ops still work).
    pub share_arena: bool,
    /// Per-uid caps for this tenant's uids (`[tenants.tenant.limits]`); a field left out
    /// comes from `[tenants.limits]`. Default: none of its own.
    pub limits: ClientLimits,
    /// Announce this tenant's blocks as KV events (with a tenant map; see docs/events.md).
    /// Events carry the blocks' exact prompt token ids and the tenant's salt to whoever
    /// reads the events socket. Default: false (its blocks are not announced).
    pub publish_events: bool,
}

/// A `[tenants]` section that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TenantConfigError {
    /// A name that is empty, too long or has other characters.
    #[error("tenant name {0:?} is not 1-{MAX_NAME} characters of A-Z a-z 0-9 _ . - : rename it")]
    BadName(String),
    /// Two tenants with one name.
    #[error("tenant {0:?} is listed twice: merge the two [[tenants.tenant]] entries")]
    DuplicateName(String),
    /// One uid or gid in two tenants.
    #[error("{what} {id} is listed in tenants {first:?} and {second:?}: give it to one")]
    DuplicateId {
        /// `uid` or `gid`.
        what: &'static str,
        /// The id.
        id: u32,
        /// First tenant.
        first: String,
        /// Second tenant.
        second: String,
    },
    /// A quota of zero bytes.
    #[error("tenant {0:?} has a quota of 0 bytes: remove the quota or give a size")]
    ZeroQuota(String),
    /// `unmapped = "refuse"` but nobody is mapped.
    #[error("[tenants] unmapped = \"refuse\" with no tenant listed would refuse every client")]
    RefuseAll,
    /// Per-uid caps that cannot work or would let one uid starve the others.
    #[error(transparent)]
    Limits(#[from] LimitsError),
}

/// Whether a tenant name is acceptable.
pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_NAME
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl TenantsConfig {
    /// Whether a tenant map is configured (otherwise: one tenant, as before tenants existed).
    pub fn enabled(&self) -> bool {
        !self.tenant.is_empty() || self.unmapped == Unmapped::Refuse
    }

    /// The map in force for a DRAM tier of `dram` bytes: with a map, unmapped identities
    /// joining `default`, and no `dram_quota` given for `default`, that tenant gets
    /// [`DEFAULT_TENANT_DRAM_SHARE`] of the tier, so anyone who can open the socket cannot
    /// hold every slot (stalled puts, a flood of blocks) against the mapped tenants. List
    /// `default` with its own `dram_quota` to choose another limit.
    #[must_use]
    pub fn with_default_quota(&self, dram: u64) -> Self {
        let mut cfg = self.clone();
        if !cfg.enabled() || cfg.unmapped != Unmapped::Default {
            return cfg;
        }
        let quota = Some((dram / DEFAULT_TENANT_DRAM_SHARE).max(4096));
        match cfg.tenant.iter_mut().find(|t| t.name == DEFAULT_TENANT) {
            Some(t) => {
                t.dram_quota = t.dram_quota.or(quota);
            }
            None => cfg.tenant.push(TenantSettings {
                name: DEFAULT_TENANT.into(),
                dram_quota: quota,
                ..TenantSettings::default()
            }),
        }
        cfg
    }

    /// Checks names, duplicates, quotas and per-uid caps (against the daemon's hard
    /// descriptor limit, to which it raises its own at start).
    pub fn validate(&self) -> Result<(), TenantConfigError> {
        let nofile = fd_hard_limit();
        self.limits.validate("[tenants.limits]", nofile)?;
        for t in &self.tenant {
            let scope = format!("tenant {:?}", t.name);
            t.limits.or(self.limits).validate(&scope, nofile)?;
        }
        if self.unmapped == Unmapped::Refuse
            && self
                .tenant
                .iter()
                .all(|t| t.uids.is_empty() && t.gids.is_empty())
        {
            return Err(TenantConfigError::RefuseAll);
        }
        let mut names = std::collections::HashSet::new();
        let mut uids: HashMap<u32, &str> = HashMap::new();
        let mut gids: HashMap<u32, &str> = HashMap::new();
        for t in &self.tenant {
            if !valid_name(&t.name) {
                return Err(TenantConfigError::BadName(t.name.clone()));
            }
            if !names.insert(t.name.as_str()) {
                return Err(TenantConfigError::DuplicateName(t.name.clone()));
            }
            if t.dram_quota == Some(0) || t.nvme_quota == Some(0) {
                return Err(TenantConfigError::ZeroQuota(t.name.clone()));
            }
            for (what, ids, seen) in [("uid", &t.uids, &mut uids), ("gid", &t.gids, &mut gids)] {
                for &id in ids {
                    if let Some(first) = seen.insert(id, &t.name)
                        && first != t.name
                    {
                        return Err(TenantConfigError::DuplicateId {
                            what,
                            id,
                            first: first.to_owned(),
                            second: t.name.clone(),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str) -> Result<TenantsConfig, String> {
        #[derive(Deserialize)]
        struct Top {
            #[serde(default)]
            tenants: TenantsConfig,
        }
        let t: Top = toml::from_str(text).map_err(|e| e.to_string())?;
        t.tenants.validate().map_err(|e| e.to_string())?;
        Ok(t.tenants)
    }

    #[test]
    fn a_documented_map_parses() {
        let c = parse(
            r#"
            [tenants]
            unmapped = "refuse"
            [[tenants.tenant]]
            name = "team-a"
            uids = [64001]
            dram_quota = "64MiB"
            nvme_quota = 1073741824
            [[tenants.tenant]]
            name = "team_b.2"
            gids = [64002]
            share_arena = true
            "#,
        )
        .unwrap();
        assert!(c.enabled());
        assert_eq!(c.tenant[0].dram_quota, Some(64 << 20));
        assert_eq!(c.tenant[0].nvme_quota, Some(1 << 30));
        assert!(c.tenant[1].share_arena && !c.tenant[0].share_arena);
        assert!(!TenantsConfig::default().enabled());
    }

    #[test]
    fn per_uid_caps_parse_globally_and_per_tenant() {
        let c = parse(
            r#"
            [tenants.limits]
            connections_per_uid = 32
            leased_blocks_per_uid = 4096
            [[tenants.tenant]]
            name = "a"
            uids = [64001]
            [tenants.tenant.limits]
            regions_per_uid = 8
            "#,
        )
        .unwrap();
        assert_eq!(c.limits.connections_per_uid, Some(32));
        let caps = c.tenant[0].limits.or(c.limits).caps(1 << 20);
        assert_eq!(
            (caps.connections, caps.regions, caps.leased_blocks),
            (32, 8, 4096)
        );
        for (text, says) in [
            (
                "[tenants.limits]\nconnections_per_uid = 0\n",
                "connections_per_uid = 0",
            ),
            ("[tenants.limits]\nsessions = 3\n", "unknown field"),
            (
                "[[tenants.tenant]]\nname = \"a\"\n[tenants.tenant.limits]\nregions_per_uid = 0\n",
                "tenant \"a\": regions_per_uid = 0",
            ),
        ] {
            let err = parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn bad_maps_are_refused_with_what_to_fix() {
        for (text, says) in [
            ("[[tenants.tenant]]\nname = \"a b\"\n", "is not 1-64"),
            ("[[tenants.tenant]]\nname = \"\"\n", "is not 1-64"),
            (
                "[[tenants.tenant]]\nname = \"a\"\n[[tenants.tenant]]\nname = \"a\"\n",
                "listed twice",
            ),
            (
                "[[tenants.tenant]]\nname = \"a\"\nuids = [5]\n[[tenants.tenant]]\nname = \"b\"\nuids = [5]\n",
                "uid 5 is listed in tenants \"a\" and \"b\"",
            ),
            (
                "[[tenants.tenant]]\nname = \"a\"\ndram_quota = 0\n",
                "quota of 0 bytes",
            ),
            ("[tenants]\nunmapped = \"refuse\"\n", "refuse every client"),
            ("[tenants]\nunmapped = \"maybe\"\n", "unknown variant"),
            (
                "[[tenants.tenant]]\nname = \"a\"\nquota = 5\n",
                "unknown field",
            ),
            (
                "[[tenants.tenant]]\nname = \"a\"\nuids = [-1]\n",
                "invalid value",
            ),
            (
                "[[tenants.tenant]]\nname = \"a\"\ndram_quota = \"lots\"\n",
                "",
            ),
        ] {
            let err = parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[derive(Serialize, Deserialize)]
    struct Top {
        tenants: TenantsConfig,
    }

    fn arb_tenant() -> impl Strategy<Value = TenantSettings> {
        (
            "[A-Za-z0-9_.-]{1,64}",
            proptest::collection::vec(any::<u32>(), 0..4),
            proptest::collection::vec(any::<u32>(), 0..4),
            proptest::option::of(1u64..1 << 50),
            proptest::option::of(1u64..1 << 50),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(
                |(name, uids, gids, dram_quota, nvme_quota, share_arena, publish_events)| {
                    TenantSettings {
                        name,
                        uids,
                        gids,
                        dram_quota,
                        nvme_quota,
                        retain_quota: dram_quota.map(|q| q / 2),
                        share_arena,
                        publish_events,
                        limits: ClientLimits::default(),
                    }
                },
            )
    }

    proptest! {
        /// Whatever the config says, serialising and parsing it gives it back, and the
        /// validator never panics (it accepts exactly the maps without duplicates).
        #[test]
        fn maps_round_trip_through_toml(
            tenants in proptest::collection::vec(arb_tenant(), 0..5),
            refuse in any::<bool>(),
        ) {
            let c = TenantsConfig {
                unmapped: if refuse { Unmapped::Refuse } else { Unmapped::Default },
                tenant: tenants,
                limits: ClientLimits::default(),
            };
            let text = toml::to_string(&Top { tenants: c.clone() }).unwrap();
            let back: Top = toml::from_str(&text).unwrap();
            prop_assert_eq!(&back.tenants, &c);
            let _ = c.validate();
        }

        /// Arbitrary text in the section is either a map or an error, never a panic.
        #[test]
        fn arbitrary_sections_never_panic(body in "[ -~\n]{0,200}") {
            let _ = parse(&format!("[tenants]\n{body}"));
            let _ = parse(&format!("[[tenants.tenant]]\n{body}"));
        }
    }
}
