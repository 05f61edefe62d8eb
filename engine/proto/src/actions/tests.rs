//! Envelope parser: each action's payload, refusals by name, and random input.

use proptest::prelude::*;

use super::*;

fn env(actions: &str) -> String {
    format!(r#"{{"protocol_version":"1.0","message_id":"m1","actions":[{actions}]}}"#)
}

fn act(kind: &str, payload: &str) -> String {
    format!(
        r#"{{"action_id":"{kind}-id","action_type":"{kind}","action_version":"1.0","payload":{payload}}}"#
    )
}

#[test]
fn every_action_kvnode_executes_parses_with_its_payload() {
    let text = env(&[
        act(
            "kv.fetch",
            r#"{"source_control_endpoint":"tcp://10.0.0.2:7000","block_hashes":[1,2]}"#,
        ),
        act(
            "kv.prefetch",
            r#"{"source_control_endpoint":"tcp://10.0.0.2:7000","block_hashes":["3",4]}"#,
        ),
        act("kv.prefetch", r#"{"block_hashes":[5]}"#),
        act(
            "kv.retain",
            r#"{"block_hashes":["18446744073709551615"],"ttl_seconds":2.5,"priority":3,"execute_at":"now"}"#,
        ),
        act("kv.release", r#"{"block_hashes":[6]}"#),
        act("kv.demote", r#"{"block_hashes":[7]}"#),
        act("kv.evict", r#"{"block_hashes":[8]}"#),
    ]
    .join(","));
    let e = parse_envelope(&text).unwrap();
    assert_eq!(e.message_id, "m1");
    let got: Vec<Action> = e.actions.into_iter().map(|p| p.action.unwrap()).collect();
    let ep = Endpoint::parse("tcp://10.0.0.2:7000").unwrap();
    assert_eq!(
        got,
        vec![
            Action::Fetch(FetchHint {
                endpoint: ep.clone(),
                block_hashes: vec![1, 2]
            }),
            Action::Prefetch {
                source: Some(ep),
                block_hashes: vec![3, 4]
            },
            Action::Prefetch {
                source: None,
                block_hashes: vec![5]
            },
            Action::Retain {
                block_hashes: vec![u64::MAX],
                ttl: Duration::from_millis(2500),
                priority: 3
            },
            Action::Release {
                block_hashes: vec![6]
            },
            Action::Demote {
                block_hashes: vec![7]
            },
            Action::Evict {
                block_hashes: vec![8]
            },
        ]
    );
}

#[test]
fn an_unknown_action_is_refused_by_name_and_the_others_still_parse() {
    let text = env(&[
        act("kv.share", r#"{"block_hashes":[1]}"#),
        act("kv.release", r#"{"block_hashes":[1]}"#),
    ]
    .join(","));
    let e = parse_envelope(&text).unwrap();
    assert_eq!(e.actions[0].action_type, "kv.share");
    assert_eq!(e.actions[0].action_id, "kv.share-id");
    let why = e.actions[0].action.clone().unwrap_err();
    assert_eq!(why, HintError::UnknownAction("kv.share".into()));
    assert!(why.to_string().contains("\"kv.share\""), "{why}");
    assert!(e.actions[1].action.is_ok());
}

#[test]
fn each_bad_payload_is_refused_with_its_reason() {
    let cases = [
        (act("kv.retain", r#"{"block_hashes":[1]}"#), "ttl_seconds"),
        (
            act("kv.retain", r#"{"block_hashes":[1],"ttl_seconds":0}"#),
            "ttl_seconds",
        ),
        (
            act("kv.retain", r#"{"block_hashes":[1],"ttl_seconds":1e12}"#),
            "ttl_seconds",
        ),
        (
            act("kv.retain", r#"{"block_hashes":[1],"ttl_seconds":"5"}"#),
            "ttl_seconds",
        ),
        (
            act(
                "kv.retain",
                r#"{"block_hashes":[1],"ttl_seconds":5,"priority":-1}"#,
            ),
            "priority",
        ),
        (
            act(
                "kv.retain",
                r#"{"block_hashes":[1],"ttl_seconds":5,"execute_at":"request_completion"}"#,
            ),
            "execute_at",
        ),
        (act("kv.demote", r#"{"block_hashes":[]}"#), "empty"),
        (act("kv.demote", r#"{"block_hashes":["-1"]}"#), "0..=2^64-1"),
        (act("kv.demote", r#"{"block_hashes":["0x10"]}"#), "0..=2^64-1"),
        (act("kv.demote", r#"{"block_hashes":[1.5]}"#), "0..=2^64-1"),
        (act("kv.demote", "{}"), "block_hashes"),
        (act("kv.demote", "[]"), "payload"),
        (
            act(
                "kv.prefetch",
                r#"{"source_control_endpoint":"tcp://0.0.0.0:1","block_hashes":[1]}"#,
            ),
            "wildcard",
        ),
        (
            r#"{"action_id":"x","action_type":"kv.demote","action_version":"2.0","payload":{"block_hashes":[1]}}"#.into(),
            "action_version",
        ),
        ("7".into(), "expected an object"),
    ];
    for (a, want) in cases {
        let e = parse_envelope(&env(&a)).unwrap();
        let why = e.actions[0].action.clone().unwrap_err().to_string();
        assert!(why.contains(want), "{a}: {why} lacks {want:?}");
    }
}

#[test]
fn envelope_faults_refuse_the_whole_envelope() {
    let one = act("kv.release", r#"{"block_hashes":[1]}"#);
    let many = vec![one.clone(); MAX_ACTIONS + 1].join(",");
    for (text, want) in [
        ("nope".to_string(), "not a JSON object"),
        ("[1]".into(), "not a JSON object"),
        (
            format!(r#"{{"protocol_version":"9","actions":[{one}]}}"#),
            "protocol_version",
        ),
        (r#"{"protocol_version":"0.1"}"#.into(), "actions"),
        (env(&many), "limit"),
        (" ".repeat(MAX_HINT_BYTES + 1), "limit"),
    ] {
        let why = parse_envelope(&text).unwrap_err().to_string();
        assert!(why.contains(want), "{why} lacks {want:?}");
    }
}

proptest! {
    /// Any text is parsed or refused without a panic.
    #[test]
    fn any_text_is_parsed_or_refused(s in ".{0,300}") {
        let _ = parse_envelope(&s);
    }

    /// Random JSON shapes in every slot of an action never panic, and every action's result
    /// keeps its place.
    #[test]
    fn any_payload_keeps_one_result_per_action(
        kinds in proptest::collection::vec(prop_oneof![
            Just("kv.retain"), Just("kv.demote"), Just("kv.prefetch"), Just("kv.fetch"),
            Just("kv.evict"), Just("kv.release"), Just("kv.other"), Just("")
        ], 0..8),
        payload in prop_oneof![
            Just("{}".to_string()), Just("null".to_string()),
            proptest::collection::vec(any::<i64>(), 0..4).prop_map(|v| format!(r#"{{"block_hashes":{v:?},"ttl_seconds":{}}}"#, v.len())),
            "[a-z0-9\":,{}\\[\\]]{0,40}",
        ],
    ) {
        let actions: Vec<String> = kinds.iter().map(|k| act(k, &payload)).collect();
        if let Ok(e) = parse_envelope(&env(&actions.join(","))) {
            prop_assert_eq!(e.actions.len(), kinds.len());
            for (p, k) in e.actions.iter().zip(&kinds) {
                prop_assert_eq!(&p.action_type, k);
            }
        }
    }
}
