"""Router hint extraction: compact form, Dynamo kv.fetch envelope (dict or SGLang's typed
KvHintsEnvelope), signed hashes, refusals."""

import json
from types import SimpleNamespace

from kvnode.hints import extract_router_hint
from kvnode.sglang.backend import router_hint_fields

EP = "tcp://10.0.0.2:7000"


def test_compact_and_envelope_forms_normalize_alike():
    compact = {"kv_hints": {"source_control_endpoint": EP, "block_hashes": [1, -1]}}
    env = {"kv_hints": {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": EP, "block_hashes": [1, (1 << 64) - 1], "mode": "copy"}}]}}
    want = {"source": EP, "block_hashes": [1, (1 << 64) - 1]}
    assert extract_router_hint(SimpleNamespace(extra_info=compact)) == want
    assert extract_router_hint(env) == want


def test_malformed_hints_are_ignored():
    bad = [None, {}, {"kv_hints": 3},
           {"kv_hints": {"source_control_endpoint": EP, "block_hashes": []}},
           {"kv_hints": {"source_control_endpoint": EP, "block_hashes": ["ab"]}},
           {"kv_hints": {"source_control_endpoint": EP, "block_hashes": [1 << 64]}},
           {"kv_hints": {"source_control_endpoint": EP, "block_hashes": [True]}},
           {"kv_hints": {"source_control_endpoint": "udp://x:1", "block_hashes": [1]}},
           {"kv_hints": {"source_control_endpoint": 7, "block_hashes": [1]}},
           {"protocol_version": "0.2", "actions": []},
           {"protocol_version": "0.1", "actions": [{"action_type": "kv.drop", "payload": {}}]},
           {"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch", "action_version": "2.0",
                                                    "payload": {"source_control_endpoint": EP, "block_hashes": [1]}}]},
           {"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch", "payload": [1]}]}]
    for b in bad:
        assert extract_router_hint(b) is None, b


def test_sglang_typed_envelope_is_read_like_its_dict():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    d = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "x", "action_type": "kv.other", "action_version": "9", "payload": {}},
        {"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": EP, "block_hashes": [-2]}}]}
    typed = decode_kv_hints_envelope(d)
    assert type(typed).__name__ == "KvHintsEnvelope"
    want = {"source": EP, "block_hashes": [(1 << 64) - 2]}
    assert extract_router_hint({"kv_hints": typed}) == want == extract_router_hint({"kv_hints": d})


def test_hint_is_attached_only_when_the_daemon_supports_it():
    h = {"source": EP, "block_hashes": [5]}
    assert router_hint_fields(h, False) == {}
    assert router_hint_fields(None, True) == {}
    sent = router_hint_fields(h, True)
    # Sent as the compact JSON form the daemon parses (and validates again).
    assert json.loads(sent["hint"]) == {"source_control_endpoint": EP, "block_hashes": [5]}


def test_recommended_timeouts_scale_the_daemon_model_and_short_sglang_ones_warn(caplog):
    from kvnode.sglang.backend import KvnodeStorage

    s = KvnodeStorage.__new__(KvnodeStorage)
    s.daemon_timeouts = {"base_s": 2.0, "per_page_s": 0.01, "measured": False}
    s._sglang_timeouts = (1.0, 0.25)
    with caplog.at_level("WARNING"):
        s._check_timeouts(64)
    assert caplog.text == "", "an unmeasured model (SGLang's own defaults) is no reason to warn"
    s.daemon_timeouts["measured"] = True
    rec = s.recommended_extra_config(page_size=64)
    assert rec == {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.01 * 1024 / 64}
    with caplog.at_level("WARNING"):
        s._check_timeouts(64)
    assert "prefetch_timeout_base" in caplog.text and "shorter" in caplog.text
    caplog.clear()
    s._sglang_timeouts = (2.0, 0.5)
    with caplog.at_level("WARNING"):
        s._check_timeouts(64)
    assert caplog.text == ""
