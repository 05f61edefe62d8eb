use proptest::prelude::*;

use super::*;

fn map(unmapped: Unmapped) -> Tenants {
    Tenants::new(&TenantsConfig {
        unmapped,
        tenant: vec![
            TenantSettings {
                name: "a".into(),
                uids: vec![64001],
                gids: vec![500],
                dram_quota: Some(1 << 20),
                ..TenantSettings::default()
            },
            TenantSettings {
                name: "b".into(),
                uids: vec![64002],
                gids: vec![600],
                ..TenantSettings::default()
            },
        ],
        ..TenantsConfig::default()
    })
}

fn spec(salt: &str) -> NamespaceSpec {
    NamespaceSpec {
        model: "m".into(),
        page_size: 1,
        segments: vec![4096],
        tenant_salt: salt.into(),
        ..NamespaceSpec::default()
    }
}

#[test]
fn uid_is_checked_before_gid_then_the_default() {
    let t = map(Unmapped::Default);
    assert_eq!(t.resolve(64001, 600), Ok(0));
    assert_eq!(t.resolve(1, 600), Ok(1));
    let d = t.resolve(1, 1).unwrap();
    assert_eq!(t.get(d).name, "default");
    assert!(!t.get(d).share_arena);
    let r = map(Unmapped::Refuse);
    assert_eq!(r.resolve(1, 1), Err(NoTenant::Unmapped));
    assert_eq!(r.len(), 2);
}

#[test]
fn without_a_map_everything_is_as_before() {
    let t = Tenants::single();
    assert!(!t.enabled());
    assert_eq!(t.resolve(12345, 6789), Ok(0));
    assert_eq!(t.scoped_spec(0, &spec("x")), spec("x"));
    assert!(t.owns(0, 77), "no map: every handle is everyone's");
    assert!(t.get(0).share_arena);
}

#[test]
fn a_client_cannot_name_another_tenants_namespace() {
    let t = map(Unmapped::Refuse);
    let a_own = t.scoped_spec(0, &spec("")).id();
    // Whatever B sends as its salt (A's name, A's derived salt, empty), its id differs.
    for salt in ["", "a", "kvnode-tenant:a", "/a", "kvnode-tenant:a/"] {
        assert_ne!(t.scoped_spec(1, &spec(salt)).id(), a_own, "salt {salt:?}");
    }
    // A can narrow within its tenant.
    assert_ne!(t.scoped_spec(0, &spec("req-7")).id(), a_own);
    assert_eq!(
        t.scoped_spec(0, &spec("req-7")).tenant_salt,
        "kvnode-tenant:a/req-7"
    );
}

#[test]
fn handles_belong_to_the_tenant_that_registered_them() {
    let t = map(Unmapped::Refuse);
    let id = t.scoped_spec(0, &spec("")).id();
    t.bind(3, id, 0);
    t.bind(3, id, 0);
    assert!(t.owns(0, 3));
    assert!(!t.owns(1, 3));
    assert!(!t.owns(0, 4), "an unbound handle is nobody's");
    assert_eq!(t.handles(0), vec![3]);
    assert_eq!(t.of_id(id), Some(0));
    assert_eq!(t.dram_scope(3), Some((0, vec![3], 1 << 20)));
    let rows = t.report(|h| u64::from(h) * 10);
    assert_eq!(rows[0].dram_bytes, 30);
    assert_eq!(rows[1].namespaces, 0);
}

proptest! {
    /// Two (tenant, client salt) pairs give one namespace id only if they are equal: no
    /// client salt of one tenant reaches another tenant's namespaces.
    #[test]
    fn scoped_ids_never_collide_across_tenants(
        ta in 0u16..2, tb in 0u16..2, sa in ".{0,12}", sb in ".{0,12}",
    ) {
        let t = map(Unmapped::Refuse);
        let (a, b) = (t.scoped_spec(ta, &spec(&sa)), t.scoped_spec(tb, &spec(&sb)));
        prop_assert_eq!(a.id() == b.id(), ta == tb && sa == sb);
    }
}
