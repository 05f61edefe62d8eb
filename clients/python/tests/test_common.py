"""The pieces the three integrations share (kvnode.common): the default socket each of them
uses, the hint field, the pull budget, and the hinted Exists -> Wait(budget) -> recount sequence
(scripted replies, then against two real daemons).

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_common.py`.
"""

import json

from kvnode.common import default_socket, hint_field, hinted_exists, pull_budget_ms
from kvnode.wire import Connection, key


def test_default_socket_is_the_env_then_the_runtime_dir_then_run(monkeypatch):
    monkeypatch.delenv("KVNODE_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_socket() == "/run/kvnode/kvnode.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert default_socket() == "/run/user/7/kvnode/kvnode.sock"
    monkeypatch.setenv("KVNODE_SOCKET", "/tmp/k.sock")
    assert default_socket() == "/tmp/k.sock"


def test_every_integration_takes_the_shared_default_socket(daemon, monkeypatch):
    from kvnode.sglang.backend import KvnodeStorage
    from kvnode.vllm.config import KvnodeVllmConfig
    from kvnode.vllm_tier.config import TierConfig
    from test_sglang_backend import config

    monkeypatch.setenv("KVNODE_SOCKET", daemon.socket)
    assert KvnodeVllmConfig.parse({}).socket == daemon.socket
    assert TierConfig.parse({}).socket == daemon.socket
    cfg = config(daemon)
    del cfg.extra_config["socket"]
    s = KvnodeStorage(cfg, {})
    try:
        assert s.socket_path == daemon.socket
    finally:
        s.close()


def test_hint_field_is_the_compact_hint_as_json_text_and_nothing_without_a_hint():
    hint = {"source": "tcp://10.0.0.2:7000", "block_hashes": (1, 2)}
    assert json.loads(hint_field(hint)["hint"]) == {"source_control_endpoint": "tcp://10.0.0.2:7000",
                                                    "block_hashes": [1, 2]}
    assert hint_field(None) == {} and hint_field({}) == {}


def test_pull_budget_is_the_daemon_model_capped_and_never_zero():
    t = {"base_s": 0.5, "per_page_s": 0.01}
    assert pull_budget_ms(t, 10) == 600
    assert pull_budget_ms(t, 10, cap_s=0.2) == 200
    assert pull_budget_ms(t, 10, cap_s=0.0) == 1
    assert pull_budget_ms(None, 10) == 1000, "no declared model: one second"


class Scripted:
    """A Connection stand-in answering Exists and Wait from a script, recording every call."""

    def __init__(self, exists_replies, wait_reply=None):
        self.exists_replies = list(exists_replies)
        self.wait_reply = wait_reply
        self.calls = []

    def call(self, op):
        (name, body), = op.items()
        self.calls.append((name, body))
        assert name == "Exists", name
        return name, self.exists_replies.pop(0), b""

    def wait(self, op, timeout_ms):
        self.calls.append(("Wait", {"op": op, "timeout_ms": timeout_ms}))
        return self.wait_reply


KEYS = [[bytes(32), 0], [bytes([1]) * 32, 0]]
HINT = {"hint": "{}"}


def test_a_running_pull_is_waited_for_within_the_budget_then_recounted_without_the_hint():
    running = {"op": 9, "state": "Pulling", "results": ["Pending", "Pending"], "reason": None}
    ended = {"op": 9, "state": "Done", "results": ["Pulled", "Pulled"], "reason": None}
    conn = Scripted([{"count": 0, "pull": running}, {"count": 2}], ended)
    found = hinted_exists(conn, 3, KEYS, HINT, 250)
    assert [c[0] for c in conn.calls] == ["Exists", "Wait", "Exists"]
    assert conn.calls[0][1] == {"ns": 3, "keys": KEYS, "hint": "{}"}
    assert conn.calls[1][1] == {"op": 9, "timeout_ms": 250}
    assert conn.calls[2][1] == {"ns": 3, "keys": KEYS}, "the recount carries no hint"
    assert (found.count, found.waited, found.started, found.report) == (2, True, running, ended)
    assert found.outcomes == ["Pulled", "Pulled"] and found.reason is None


def test_without_a_recount_the_report_is_the_answer():
    running = {"op": 4, "state": "Pulling", "results": ["Pending"], "reason": None}
    failed = {"op": 4, "state": "Failed", "results": [{"Failed": {"code": "Deadline", "message": ""}}],
              "reason": {"code": "Deadline", "message": "deadline passed"}}
    conn = Scripted([{"count": 0, "pull": running}], failed)
    found = hinted_exists(conn, 3, KEYS[:1], HINT, 10, recount=False)
    assert [c[0] for c in conn.calls] == ["Exists", "Wait"]
    assert found.count == 0 and found.waited and found.reason["code"] == "Deadline"


def test_a_pull_that_never_ran_or_ended_at_once_is_not_waited_for():
    refused = {"op": 5, "state": "Failed", "results": [], "reason": {"code": "NotAuthorized", "message": ""}}
    for reply in ({"count": 1, "pull": None}, {"count": 1, "pull": refused}):
        conn = Scripted([reply])
        found = hinted_exists(conn, 3, KEYS, HINT, 10)
        assert [c[0] for c in conn.calls] == ["Exists"]
        assert found.count == 1 and not found.waited and found.report is reply["pull"]


def test_ask_replaces_the_exists_call_and_wait_stays_on_the_connection():
    running = {"op": 2, "state": "Pulling", "results": ["Pending"], "reason": None}
    conn = Scripted([], {"op": 2, "state": "Done", "results": ["Pulled"], "reason": None})
    asked = []
    replies = [{"count": 0, "pull": running}, {"count": 1}]

    def ask(keys, extra):
        asked.append(extra)
        return replies.pop(0)

    found = hinted_exists(conn, 3, KEYS[:1], HINT, 10, ask=ask)
    assert asked == [HINT, None] and [c[0] for c in conn.calls] == ["Wait"]
    assert found.count == 1


def test_a_hinted_lookup_on_a_real_daemon_waits_for_the_peer_pull_and_counts_it(pair):
    a_daemon, pa, b_daemon, _dead = pair
    spec = {"model": "common-hinted", "page_size": 4, "segments": [4096]}
    digests = [bytes([i + 1]) * 32 for i in range(6)]
    keys = [key(d) for d in digests]
    a, b = Connection(a_daemon.socket), Connection(b_daemon.socket)
    try:
        ns_a, ns_b = a.register(spec)["ns"], b.register(spec)["ns"]
        assert a.put(ns_a, keys, [bytes([i]) * 4096 for i in range(6)]) == ["Stored"] * 6
        hint = {"source": f"tcp://127.0.0.1:{pa}",
                "block_hashes": [int.from_bytes(d[:8], "big") for d in digests]}
        budget = pull_budget_ms(b.call("Timeouts")[1], len(keys))
        found = hinted_exists(b, ns_b, keys, hint_field(hint), budget)
        assert found.started["state"] == "Pulling" and found.waited
        assert found.report["state"] == "Done" and found.outcomes == ["Pulled"] * 6
        assert found.count == 6, "the recount sees the pulled blocks"
        assert b.get(ns_b, keys[:1])[0] == bytes(4096)
    finally:
        a.close()
        b.close()
