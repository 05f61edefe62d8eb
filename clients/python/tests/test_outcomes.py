"""The Python mirror of the daemon's failure codes: every Rust FailCode variant has a member,
and outcomes decode as the daemon encodes them. Run: pytest clients/python/tests/test_outcomes.py
"""

import pathlib
import re

from kvnode.outcomes import FailCode, failure_of, usable

PULL_RS = pathlib.Path(__file__).resolve().parents[3] / "engine" / "proto" / "src" / "pull.rs"


def test_every_rust_fail_code_has_a_python_member():
    text = PULL_RS.read_text()
    body = text[text.index("pub enum FailCode"):]
    body = body[: body.index("\n}")]
    rust = set(re.findall(r"^\s{4}([A-Z][A-Za-z]+),", body, re.M))
    assert rust, "no variants parsed from pull.rs"
    assert rust == {c.value for c in FailCode}


def test_failed_outcomes_and_reasons_decode_to_code_and_message():
    outcome = {"Failed": {"code": "Deadline", "message": "deadline passed"}}
    assert failure_of(outcome) == (FailCode.DEADLINE, "deadline passed")
    assert failure_of({"code": "NotAuthorized", "message": "x"}) == (FailCode.NOT_AUTHORIZED, "x")
    assert failure_of("HitLocal") is None and failure_of(None) is None
    assert failure_of({"Failed": {"code": "SomethingNew", "message": ""}})[0] is FailCode.PEER_FAILED
    assert usable("Pulled") and usable("HitLocal") and not usable("Missed") and not usable(outcome)


def test_a_real_daemon_reports_refusals_with_codes(daemon):
    from kvnode.wire import Connection, key

    c = Connection(daemon.socket)
    ns = c.register({"model": "outcomes", "page_size": 64, "segments": [4096]})["ns"]
    keys = [key(bytes([i]) * 32) for i in range(2)]
    _, reply, _ = c.call({"Exists": {"ns": ns, "keys": keys, "hint": "[]"}})
    assert failure_of(reply["pull"]["reason"])[0] is FailCode.MALFORMED_HINT
    hashes = [int.from_bytes(bytes([i]) * 8, "big") for i in range(2)]
    hint = '{"source_control_endpoint":"tcp://127.0.0.1:9","block_hashes":%s}' % hashes
    _, reply, _ = c.call({"Exists": {"ns": ns, "keys": keys, "hint": hint}})
    code, message = failure_of(reply["pull"]["reason"])
    assert code is FailCode.NOT_AUTHORIZED and "not an authorized peer" in message
    c.close()
