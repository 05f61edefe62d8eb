use std::time::Duration;

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::PeerMsg;

use super::*;

fn ep(s: &str) -> Endpoint {
    Endpoint::parse(s).unwrap()
}

#[test]
fn each_concern_keeps_the_client_failure_code_of_its_kind() {
    let cases: Vec<(PeerError, FailCode)> = vec![
        (
            std::io::Error::from(std::io::ErrorKind::BrokenPipe).into(),
            FailCode::PeerUnreachable,
        ),
        (
            PeerError::timeout(Stage::BlockBytes, Duration::from_secs(1)),
            FailCode::PeerUnreachable,
        ),
        (
            WireError::Integrity(IntegrityCheck::Frame).into(),
            FailCode::PeerFailed,
        ),
        (
            HandshakeError::DestinationProof.into(),
            FailCode::PeerRefused,
        ),
        (
            HandshakeError::Refused(Verbatim::from("busy")).into(),
            FailCode::PeerRefused,
        ),
        (
            Violation::AnsweredTwice { key: 3 }.into(),
            FailCode::PeerFailed,
        ),
        (PullError::Deadline.into(), FailCode::Deadline),
        (
            PullError::Busy {
                peer: ep("tcp://10.0.0.1:7000"),
            }
            .into(),
            FailCode::PeerBusy,
        ),
        (ConfigError::NoKeyFile.into(), FailCode::PeerRefused),
        (ConfigError::ZeroTimeout.into(), FailCode::PeerFailed),
    ];
    for (e, want) in cases {
        assert_eq!(e.code(), want, "{e}");
        assert_eq!(e.failure().code, want);
    }
}

#[test]
fn messages_name_the_stage_the_ids_and_what_to_change() {
    let e = PeerError::timeout(Stage::BlockBytes, Duration::from_millis(500));
    assert_eq!(
        e.to_string(),
        "peer block bytes timed out after 500ms (peer dead or frozen?)"
    );
    assert_eq!(e.timed_out(), Some(Stage::BlockBytes));
    let e = PeerError::from(HandshakeError::NoCommonKey {
        theirs: KeyIds(vec![1, 2]),
        ours: KeyIds(vec![0xab]),
    });
    assert_eq!(
        e.to_string(),
        "peer authentication failed: no cluster key in common: the peer holds \
         0000000000000001, 0000000000000002, this daemon 00000000000000ab"
    );
    let e = PeerError::from(Violation::FromSource {
        got: Box::new(PeerMsg::Ready),
    });
    assert_eq!(
        e.to_string(),
        "peer protocol violation: unexpected Ready from a source"
    );
    let e = ConfigError::OutOfRange {
        field: "batch_keys",
        value: 0,
        min: 1,
        max: 4096,
    };
    assert_eq!(
        e.to_string(),
        "invalid peer configuration: peer batch_keys is 0; it must be 1..=4096"
    );
    let e = ConfigError::Key {
        path: "/etc/kvnode/cluster.key".into(),
        problem: KeyProblem::ShortKey { bytes: 5 },
    };
    assert!(
        e.to_string().starts_with(
            "cluster key: /etc/kvnode/cluster.key: a key of 5 bytes; a cluster key needs at least 16"
        ),
        "{e}"
    );
}

#[test]
fn a_stale_pooled_connection_is_told_apart_from_a_bad_frame() {
    let io: PeerError = std::io::Error::from(std::io::ErrorKind::ConnectionReset).into();
    let cut: PeerError = WireError::Truncated { got: 1, want: 2 }.into();
    let bad: PeerError = WireError::Integrity(IntegrityCheck::Body).into();
    assert!(io.is_broken_connection() && cut.is_broken_connection());
    assert!(!bad.is_broken_connection() && bad.is_bad_frame());
    assert!(!PeerError::timeout(Stage::Answer, Duration::ZERO).is_broken_connection());
}
