//! Which tenants' blocks are announced, and the event account each is charged to.
//!
//! KV events carry a block's exact prompt token ids and its tenant salt, and whoever reads
//! the events socket reads them for every tenant. Without a tenant map there is one tenant
//! and every block with metadata is announced. With a map, a tenant's blocks are announced
//! only when its `[[tenants.tenant]]` says `publish_events = true`; the others' stores never
//! leave the daemon (the router does not route to them). Each publishing tenant is charged
//! for its events in the publisher's queue and replay ring, up to 1/[`EVENT_SHARE`] of its
//! DRAM allowance in each (the same share its router metadata may hold), so one tenant's
//! flood is dropped and counted on its own account.
//!
//! A block's tenant is read from its salt: under a map every namespace's salt is
//! `kvnode-tenant:<name>[/<client salt>]`, chosen by the daemon, and names hold no `/`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvnode_events::{Account, AccountStats};

use crate::tenant::{SALT_PREFIX, TenantsConfig};

/// A publishing tenant may hold 1/this of its DRAM allowance in queued events, and as
/// much again in the replay ring.
pub const EVENT_SHARE: u64 = 16;

/// Who is announced and charged.
#[derive(Debug, Default)]
pub struct Policy {
    /// `None`: no tenant map, every block is announced, charged to nobody but the queue.
    tenants: Option<HashMap<String, Arc<Account>>>,
    /// Stores not announced because their tenant does not publish.
    withheld: AtomicU64,
}

/// What to do with one block's store.
#[derive(Debug)]
pub(crate) enum Decision<'a> {
    /// Announce it, charged to this account (if any).
    Publish(Option<&'a Arc<Account>>),
    /// Its tenant does not publish events.
    Withhold,
}

impl Policy {
    /// Every block announced (no tenant map).
    pub fn all() -> Self {
        Self::default()
    }

    /// The policy of a tenant map for a DRAM tier of `dram` bytes; without a map,
    /// [`Policy::all`].
    pub fn for_tenants(cfg: &TenantsConfig, dram: u64) -> Self {
        if !cfg.enabled() {
            return Self::all();
        }
        let cfg = cfg.with_default_quota(dram);
        let tenants = cfg
            .tenant
            .iter()
            .filter(|t| t.publish_events)
            .map(|t| {
                let limit = t.dram_quota.unwrap_or(dram).min(dram) / EVENT_SHARE;
                (t.name.clone(), Account::new(t.name.clone(), limit.max(1)))
            })
            .collect();
        Self {
            tenants: Some(tenants),
            withheld: AtomicU64::new(0),
        }
    }

    /// The decision for a block whose namespace has `salt`.
    pub(crate) fn decide(&self, salt: Option<&str>) -> Decision<'_> {
        let Some(map) = &self.tenants else {
            return Decision::Publish(None);
        };
        let tenant = salt
            .and_then(|s| s.strip_prefix(SALT_PREFIX))
            .map(|rest| rest.split('/').next().unwrap_or(rest));
        if let Some(a) = tenant.and_then(|t| map.get(t)) {
            Decision::Publish(Some(a))
        } else {
            self.withheld.fetch_add(1, Relaxed);
            Decision::Withhold
        }
    }

    /// Stores withheld so far.
    pub fn withheld(&self) -> u64 {
        self.withheld.load(Relaxed)
    }

    /// Each publishing tenant's account, by name.
    pub fn accounts(&self) -> Vec<AccountStats> {
        let mut v: Vec<AccountStats> = self
            .tenants
            .iter()
            .flat_map(HashMap::values)
            .map(|a| a.stats())
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::TenantSettings;

    #[test]
    fn only_tenants_that_say_so_are_announced_each_on_its_own_account() {
        let cfg = TenantsConfig {
            tenant: vec![
                TenantSettings {
                    name: "a".into(),
                    uids: vec![1],
                    dram_quota: Some(8 << 20),
                    publish_events: true,
                    ..TenantSettings::default()
                },
                TenantSettings {
                    name: "b".into(),
                    uids: vec![2],
                    ..TenantSettings::default()
                },
            ],
            ..TenantsConfig::default()
        };
        let p = Policy::for_tenants(&cfg, 1 << 30);
        let Decision::Publish(Some(a)) = p.decide(Some("kvnode-tenant:a/x/y")) else {
            panic!("a publishes");
        };
        assert_eq!((a.name(), a.stats().limit), ("a", 512 << 10));
        assert!(matches!(
            p.decide(Some("kvnode-tenant:b")),
            Decision::Withhold
        ));
        assert!(matches!(
            p.decide(Some("kvnode-tenant:default")),
            Decision::Withhold
        ));
        assert!(matches!(p.decide(Some("a")), Decision::Withhold));
        assert!(matches!(p.decide(None), Decision::Withhold));
        assert_eq!(p.withheld(), 4);
        assert_eq!(p.accounts().len(), 1);
        assert!(matches!(
            Policy::for_tenants(&TenantsConfig::default(), 1 << 30).decide(None),
            Decision::Publish(None)
        ));
    }
}
