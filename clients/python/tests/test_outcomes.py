"""The Python mirror of the daemon's outcomes: every Rust FailCode variant has a member, the
put and commit sets name Rust variants and match what a real daemon answers, and failures decode
as the daemon encodes them. Run: pytest clients/python/tests/test_outcomes.py
"""

import pathlib
import re

from kvnode.outcomes import COMMIT_OK, PUT_OK, FailCode, committed, failure_of, stored, usable

PROTO = pathlib.Path(__file__).resolve().parents[3] / "engine" / "proto" / "src"


def rust_variants(file: str, enum: str) -> set:
    text = (PROTO / file).read_text()
    body = text[text.index(f"pub enum {enum} {{"):]
    body = body[: body.index("\n}")]
    rust = set(re.findall(r"^\s{4}([A-Z][A-Za-z]+),", body, re.M))
    assert rust, f"no variants of {enum} parsed from {file}"
    return rust


def test_every_rust_fail_code_has_a_python_member():
    assert rust_variants("pull.rs", "FailCode") == {c.value for c in FailCode}


def test_the_put_and_commit_sets_name_rust_variants():
    assert PUT_OK == {"Stored", "Exists"} and PUT_OK < rust_variants("client.rs", "PutStatus")
    assert COMMIT_OK == {"Committed", "Duplicate"} and COMMIT_OK < rust_variants("client.rs", "CommitStatus")


def test_a_real_daemon_answers_stores_in_the_sets(daemon):
    from kvnode.wire import Connection, key

    c = Connection(daemon.socket)
    try:
        ns = c.register({"model": "put-sets", "page_size": 4, "segments": [4096]})["ns"]
        k = [key(bytes([i + 1]) * 32) for i in range(3)]
        first, again = c.put(ns, k[:1], [b"a"]), c.put(ns, k[:1], [b"b"])
        assert (first, again) == (["Stored"], ["Exists"]) and stored(first[0]) and stored(again[0])
        too_large = c.put(ns, k[1:2], [bytes(4097)])
        assert too_large == ["TooLarge"] and not stored(too_large[0])
        slots = c.alloc(ns, k[2:3] * 2, [8, 8])
        handles = [s["Granted"]["handle"] for s in slots if "Granted" in s]
        res = c.commit(handles)
        assert res == ["Committed", "Duplicate"] and all(committed(r) for r in res), res
        assert not committed("UnknownHandle")
    finally:
        c.close()


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
