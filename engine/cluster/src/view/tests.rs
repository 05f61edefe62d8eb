use super::*;

fn local(grace_s: u64) -> Local {
    Local {
        name: "t".into(),
        etcd: vec!["127.0.0.1:2379".into()],
        node_id: "me".into(),
        peer_protocol: 1,
        key_id: Some("k1".into()),
        ttl_s: 3,
        grace: Duration::from_secs(grace_s),
    }
}

fn rec(id: &str, ep: &str, instance: &str) -> MemberRecord {
    MemberRecord {
        node_id: id.into(),
        instance: instance.into(),
        endpoints: vec![ep.into()],
        peer_protocol: 1,
        key_id: Some("k1".into()),
        ..MemberRecord::default()
    }
}

#[test]
fn nothing_is_authorized_before_etcd_first_answers() {
    let v = View::new(local(30));
    assert_eq!(v.check("10.0.0.1", 7700), Verdict::NeverConfirmed);
    assert_eq!(v.state(), ClusterState::Connecting);
    assert!(!v.summary().in_force);
}

#[test]
fn live_members_are_authorized_at_their_advertised_endpoint_only() {
    let v = View::new(local(30));
    v.reload(vec![rec("a", "tcp://10.0.0.1:7700", "i1")]);
    assert_eq!(v.check("10.0.0.1", 7700), Verdict::Member("a".into()));
    assert_eq!(v.check("10.0.0.1", 7701), Verdict::NotMember);
    assert_eq!(v.check("10.0.0.2", 7700), Verdict::NotMember);
    // Back at a new address: the old one is refused.
    let c = v.upsert(rec("a", "tcp://10.0.0.9:7700", "i2"));
    assert_eq!(
        c,
        Change::Moved {
            from: vec!["tcp://10.0.0.1:7700".into()]
        }
    );
    assert_eq!(v.check("10.0.0.1", 7700), Verdict::NotMember);
    assert_eq!(v.check("10.0.0.9", 7700), Verdict::Member("a".into()));
    assert_eq!(v.remove("a").map(|r| r.instance), Some("i2".into()));
    assert_eq!(v.check("10.0.0.9", 7700), Verdict::NotMember);
    assert!(v.is_empty());
}

#[test]
fn other_protocol_versions_and_keys_are_listed_but_refused() {
    let v = View::new(local(30));
    let mut newer = rec("b", "tcp://h:1", "i");
    newer.peer_protocol = 2;
    let mut other_key = rec("c", "tcp://h:2", "i");
    other_key.key_id = Some("k2".into());
    v.reload(vec![newer, other_key]);
    assert!(matches!(
        v.check("h", 1),
        Verdict::Incompatible {
            theirs: 2,
            ours: 1,
            ..
        }
    ));
    assert!(matches!(v.check("H", 2), Verdict::KeyMismatch { .. }));
    let r = v.report();
    assert_eq!(r.members.len(), 2);
    assert!(r.members.iter().all(|m| !m.compatible));
    assert_eq!(r.summary.incompatible_members, 1);
}

#[test]
fn membership_stays_in_force_for_the_grace_then_expires() {
    let v = View::new(local(5));
    v.reload(vec![rec("a", "tcp://10.0.0.1:7700", "i")]);
    assert!(v.lost("etcd down".into()));
    assert!(
        !v.lost("still down".into()),
        "only the first loss is a transition"
    );
    assert_eq!(v.state(), ClusterState::Degraded);
    assert_eq!(v.check("10.0.0.1", 7700), Verdict::Member("a".into()));
    let later = Instant::now() + Duration::from_secs(6);
    assert!(matches!(
        v.check_at("10.0.0.1", 7700, later),
        Verdict::Expired { .. }
    ));
    let s = v.summary();
    assert!(!s.etcd_healthy && !s.registered && s.in_force);
    assert_eq!(s.last_error.as_deref(), Some("still down"));
    // etcd answers again: a fresh listing restores the state.
    v.reload(vec![rec("a", "tcp://10.0.0.1:7700", "i")]);
    assert_eq!(v.state(), ClusterState::Healthy);
    assert!(v.check_at("10.0.0.1", 7700, later).authorizes());
}

#[test]
fn every_refusal_names_the_endpoint_and_the_reason() {
    for (v, want) in [
        (Verdict::NotMember, "not a live cluster member"),
        (Verdict::NeverConfirmed, "etcd has not answered"),
        (
            Verdict::Expired {
                unreachable_for: Duration::from_secs(40),
            },
            "past the membership grace",
        ),
        (
            Verdict::Incompatible {
                node_id: "b".into(),
                theirs: 2,
                ours: 1,
            },
            "peer protocol v2",
        ),
    ] {
        let m = v.describe("tcp://h:1");
        assert!(m.contains("tcp://h:1") && m.contains(want), "{m}");
        assert!(!v.authorizes());
    }
}

#[test]
fn members_rolling_keys_are_compatible_while_they_share_one() {
    use super::keys_compatible;
    assert!(keys_compatible(Some("aa,bb"), Some("bb")));
    assert!(keys_compatible(Some("aa"), Some("cc,aa")));
    assert!(!keys_compatible(Some("aa,bb"), Some("cc")));
    assert!(keys_compatible(None, Some("cc")));
}
