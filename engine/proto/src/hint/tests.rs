//! Hint parser: every interop.md §3 rejection rule, both forms, and random input.

use proptest::prelude::*;

use super::*;
use crate::key::Digest;

fn envelope(payload: &str) -> String {
    format!(
        r#"{{"protocol_version":"0.1","message_id":"m","actions":[{{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{payload}}}]}}"#
    )
}

#[test]
fn envelope_and_compact_forms_parse_to_the_same_hint() {
    let p = r#"{"source_control_endpoint":"tcp://10.0.0.2:7000","block_hashes":[1,18446744073709551615],"mode":"copy"}"#;
    let a = parse_hint(&envelope(p)).unwrap();
    let b = parse_hint(p).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.endpoint.to_string(), "tcp://10.0.0.2:7000");
    assert_eq!(a.block_hashes, vec![1, u64::MAX]);
    let v6 = parse_hint(r#"{"source_control_endpoint":"tcp://[fd00::2]:9","block_hashes":[3]}"#)
        .unwrap();
    assert_eq!(v6.endpoint.host, "fd00::2");
    assert_eq!(v6.endpoint.to_string(), "tcp://[fd00::2]:9");
}

#[test]
fn every_interop_rejection_rule_has_a_clear_reason() {
    let ok = r#"{"source_control_endpoint":"tcp://h:1","block_hashes":[1]}"#;
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "not a JSON object"),
        ("[1,2]".into(), "not a JSON object"),
        (
            envelope(ok).replace("\"0.1\"", "\"0.2\""),
            "protocol_version",
        ),
        (envelope(ok).replace("\"1.0\"", "\"2.0\""), "action_version"),
        (envelope(ok).replace("kv.fetch", "kv.store"), "no kv.fetch"),
        (
            r#"{"protocol_version":"0.1","actions":[]}"#.into(),
            "no kv.fetch",
        ),
        (ok.replace("[1]", "[]"), "empty"),
        (ok.replace("[1]", "[-1]"), "not an integer in 0..=2^64-1"),
        (
            ok.replace("[1]", "[18446744073709551616]"),
            "not an integer in 0..=2^64-1",
        ),
        (ok.replace("[1]", "[1.5]"), "not an integer"),
        (ok.replace("[1]", "[\"1\"]"), "not an integer"),
        (ok.replace("[1]", "7"), "expected an array"),
        (
            ok.replace("tcp://h:1", "udp://h:1"),
            "is not tcp://host:port",
        ),
        (
            ok.replace("tcp://h:1", "tcp://h:0"),
            "is not tcp://host:port",
        ),
        (
            ok.replace("tcp://h:1", "tcp://h:65536"),
            "is not tcp://host:port",
        ),
        (ok.replace("tcp://h:1", "tcp://h"), "is not tcp://host:port"),
        (
            ok.replace("tcp://h:1", "tcp://:5"),
            "is not tcp://host:port",
        ),
        (
            ok.replace("tcp://h:1", "tcp://a b:5"),
            "is not tcp://host:port",
        ),
        (
            ok.replace("tcp://h:1", "tcp://::1:5"),
            "is not tcp://host:port",
        ),
        (ok.replace("tcp://h:1", "tcp://0.0.0.0:5"), "bind wildcard"),
        (ok.replace("tcp://h:1", "tcp://[::]:5"), "bind wildcard"),
        (ok.replace("tcp://h:1", "tcp://*:5"), "bind wildcard"),
        (
            r#"{"block_hashes":[1]}"#.into(),
            "source_control_endpoint: missing",
        ),
        (
            ok.replace('}', r#","mode":"move"}"#),
            "mode \"move\" is not supported",
        ),
    ];
    for (text, want) in cases {
        let e = parse_hint(&text).expect_err(&text).to_string();
        assert!(e.contains(want), "{text}: got {e:?}, want {want:?}");
    }
}

#[test]
fn covered_keys_stops_at_the_first_mismatching_page() {
    let d = |i: u8| Digest([i; 32]);
    let keys = [Key(d(1), 0), Key(d(1), 1), Key(d(2), 0), Key(d(3), 0)];
    let h = |i: u8| d(i).router_hash();
    assert_eq!(covered_keys(&[h(1), h(2), h(3)], &keys).unwrap(), 4);
    assert_eq!(covered_keys(&[h(1), h(2)], &keys).unwrap(), 3);
    assert_eq!(covered_keys(&[h(1), h(9), h(3)], &keys).unwrap(), 2);
    // A request further down the chain matches from its own first page.
    assert_eq!(covered_keys(&[h(1), h(2), h(3)], &keys[2..]).unwrap(), 2);
    let e = covered_keys(&[h(9)], &keys).unwrap_err();
    assert!(e.to_string().contains("another prefix"), "{e}");
}

proptest! {
    #[test]
    fn hint_parser_never_panics_on_random_text(s in ".{0,200}") {
        let _ = parse_hint(&s);
    }

    #[test]
    fn hint_parser_survives_mutated_envelopes(i in 0usize..200, c in any::<char>()) {
        let mut s: Vec<char> = envelope(r#"{"source_control_endpoint":"tcp://10.1.2.3:70","block_hashes":[1,2,3]}"#).chars().collect();
        let i = i % s.len();
        s[i] = c;
        let s: String = s.into_iter().collect();
        if let Ok(h) = parse_hint(&s) {
            prop_assert!(!h.block_hashes.is_empty());
            prop_assert!(h.endpoint.port != 0);
        }
    }
}
