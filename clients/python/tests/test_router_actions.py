"""Router actions other than kv.fetch through SGLang's storage backend, against real daemons:
the envelope's split (kvnode.hints.split_envelope), the backend's one `Act` per envelope and key
at the first storage call that carries the request's kv_hints (batch_exists), and the same
through SGLang's own /generate request path with the seam (tests/sglang_stack.py).

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_router_actions.py`.
"""

import json
import logging

from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.utils import hash_str_to_int64

import sglang_pools as sp
from kvnode.hints import AT_COMPLETION, extract_router_hint, split_envelope
from kvnode.wire import Connection
from test_router_hint_e2e import body, envelope, prefetchable, request, store_on_a, tokens, workers  # noqa: F401
from test_sglang_backend import hashes, storage

EP = "tcp://10.0.0.2:7000"


def action(aid, kind, **payload):
    return {"action_id": aid, "action_type": kind, "action_version": "1.0", "payload": payload}


def retained(socket) -> int:
    c = Connection(socket)
    try:
        return next(t for t in c.stats()["tiers"] if t["tier"] == "dram")["retained_blocks"]
    finally:
        c.close()


def test_envelope_splits_into_the_fetch_hint_actions_now_and_actions_at_completion():
    env = {"protocol_version": "0.1", "message_id": "m-7", "actions": [
        action("f", "kv.fetch", source_control_endpoint=EP, block_hashes=[-2]),
        action("r", "kv.retain", block_hashes=[-2, 5], ttl_seconds=30),
        action("u", "kv.unheard", block_hashes=[1]),
        action("f2", "kv.fetch", source_control_endpoint=EP, block_hashes=[9]),
        action("d", "kv.release", block_hashes=[5], execute_at=AT_COMPLETION),
        "not an action"]}
    assert extract_router_hint({"kv_hints": env}) == {"source": EP, "block_hashes": [(1 << 64) - 2]}
    acts = split_envelope({"kv_hints": env})
    assert acts.message_id == acts.key == "m-7"
    # Only the kv.fetch the hinted lookup takes is left out; nothing else is dropped.
    assert [a if isinstance(a, str) else a["action_id"] for a in acts.now] == ["r", "u", "f2", "not an action"]
    assert [a["action_id"] for a in acts.at_completion] == ["d"]
    now = json.loads(acts.now_text())
    assert now["protocol_version"] == "0.1" and now["message_id"] == "m-7"
    assert now["actions"][0]["payload"]["block_hashes"] == [(1 << 64) - 2, 5], "signed i64 sent as u64"
    done = json.loads(acts.completion_text())["actions"]
    assert done == [action("d", "kv.release", block_hashes=[5])], "execute_at removed at completion"
    every = json.loads(acts.unplaced_text())["actions"]
    assert every[-1]["payload"]["execute_at"] == AT_COMPLETION, "unplaced: sent as written"
    # A typed envelope (SGLang's KvHintsEnvelope) splits like its dict; no envelope, nothing.
    assert split_envelope({"kv_hints": decode_kv_hints_envelope({**env, "actions": env["actions"][:5]})}).now == acts.now[:3]
    assert split_envelope({"kv_hints": {"source_control_endpoint": EP, "block_hashes": [1]}}) is None
    assert split_envelope({"kv_hints": {**env, "actions": env["actions"][:1]}}) is None
    # A kv.fetch the hinted lookup refuses (protocol 1.0) is not dropped: it goes to Act.
    v1 = split_envelope({"kv_hints": {**env, "protocol_version": "1.0"}})
    assert [a["action_id"] for a in v1.now[:2]] == ["f", "r"]
    # No message_id: the envelope's own digest tells repeated calls apart.
    anon = split_envelope({"kv_hints": {k: v for k, v in env.items() if k != "message_id"}})
    assert anon.message_id == "" and len(anon.key) == 64


def test_sglang_backend_acts_once_at_batch_exists_and_counts_refused_unknown_and_deferred_actions(daemon, caplog):
    pool = sp.mha_pool("page_first", pages=16)
    s = storage(daemon, pool)
    keys = hashes(6, seed=3)
    assert s.batch_set_v1(keys, sp.indices(pool, range(6))) == [True] * 6
    routed = [hash_str_to_int64(k) for k in keys]  # the signed hashes SGLang's KV events publish
    env = decode_kv_hints_envelope({"protocol_version": "0.1", "message_id": "req-1", "actions": [
        action("keep", "kv.retain", block_hashes=routed[:2], ttl_seconds=60),
        action("odd", "kv.unheard", block_hashes=routed[:1]),
        action("later", "kv.retain", block_hashes=routed[2:4], ttl_seconds=60, execute_at=AT_COMPLETION)]})
    extra = HiCacheStorageExtraInfo(extra_info={"kv_hints": env})  # what the seam's controller passes
    assert retained(daemon.socket) == 0
    with caplog.at_level(logging.WARNING, logger="kvnode.sglang_backend"):
        # SGLang asks in batches (STORAGE_BATCH_SIZE): each batch's keys, then the same again.
        assert s.batch_exists(keys[:3], extra) == 3
        assert retained(daemon.socket) == 2 * s.seg_n, "kv.retain executed at the first batch_exists"
        assert s.batch_exists(keys[3:], extra) == 3
        assert s.batch_exists(keys, extra) == 6
        assert s.batch_get_v1(keys[:2], sp.indices(pool, range(8, 10)), extra) == [True, True]
    assert s.actions.take() == {"actions_sent": 3, "actions_refused": 2}
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in refusals]
    assert "'odd' (kv.unheard)" in refusals[0].getMessage()
    assert "'later' (kv.retain)" in refusals[1].getMessage() and AT_COMPLETION in refusals[1].getMessage()
    # SGLang 0.5.23 calls no backend method when a request ends: the deferred retain never runs.
    assert retained(daemon.socket) == 2 * s.seg_n
    s.close()


def test_generate_body_actions_reach_bs_daemon_after_the_hinted_pull_through_sglangs_request_path(workers, caplog):
    w = workers
    toks = tokens(6, seed=11)
    keys, _ = store_on_a(w, toks, 0)
    env = envelope(w["pa"], keys)
    routed = env["actions"][0]["payload"]["block_hashes"]
    env["actions"] += [action("keep", "kv.retain", block_hashes=routed[:3], ttl_seconds=60),
                       action("odd", "kv.unheard", block_hashes=routed[:1]),
                       action("later", "kv.retain", block_hashes=routed[3:5], ttl_seconds=60,
                              execute_at=AT_COMPLETION)]
    req = request(body(toks, env))
    b_socket = w["b"].socket_path
    with caplog.at_level(logging.WARNING, logger="kvnode.sglang_backend"):
        assert w["wb"].prefetch(req) == prefetchable(toks), "the kv.fetch still pulls from A"
    assert retained(b_socket) == 3 * w["b"].seg_n, "kv.retain covers the pages the hint pulled"
    assert w["b"].actions.take() == {"actions_sent": 3, "actions_refused": 2}
    assert ["'odd' (kv.unheard)" in m or "'later' (kv.retain)" in m
            for m in (r.getMessage() for r in caplog.records if "refused" in r.getMessage())] == [True, True]
