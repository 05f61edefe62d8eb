"""Fetch plans through the kvnode tier (issue 41): with `recompute_tokens_per_s` in the tier's
`secondary_tiers` entry every lookup's `Exists` carries the engine's cost (chunks of
tokens_per_block x blocks_per_chunk tokens, one key each) and only the chunks before the plan's
cut are hits: vLLM computes the rest. Without it nothing is sent and every held chunk is a hit.

The seam: `Connection.call` is wrapped so that an `Exists` carrying `recompute` comes back with a
plan cutting at `cut` keys. The last test has no seam: the daemon's own plan over a DRAM-held
prefix, cut by an absurdly fast recompute cost (NVMe-held prefixes: tests/test_plan_e2e.py).
"""

from vllm.v1.kv_offload.base import ReqContext

from conftest import BLOCK
from kvnode.wire import Connection
from tier_env import Engine, counters, keys_and_rows


def planner(monkeypatch, cut: int) -> list:
    sent = []
    real = Connection.call

    def call(conn, op, *a, **kw):
        name, body, data = real(conn, op, *a, **kw)
        ex = op.get("Exists") if isinstance(op, dict) else None
        if ex is not None and ex.get("recompute"):
            sent.append(ex["recompute"])
            keys = min(cut, len(ex["keys"]))
            body = dict(body, plan={"keys": keys, "runs": [{"source": "nvme", "keys": keys}],
                                    "fetch_s": 0.001, "recompute_s": 0.002, "reason": "slower",
                                    "cut_by": "nvme", "available": body["count"], "note": "injected"})
        return name, body, data

    monkeypatch.setattr(Connection, "call", call)
    return sent


def _lookup(model_dir, daemon, monkeypatch, tier, cut):
    monkeypatch.delenv("KVNODE_RECOMPUTE_TOKENS_PER_S", raising=False)
    writer = Engine(model_dir, daemon.socket)
    reader = Engine(model_dir, daemon.socket, tier=tier)
    try:
        keys, rows, _ = keys_and_rows(6)
        writer.store(keys, rows)
        sent = planner(monkeypatch, cut)
        ctx = ReqContext(req_id="r")
        with reader.m.lock:
            reader.m.on_new_request(ctx)
        hits, _, _ = reader.lookup(keys, ctx)
        return hits, sent, counters(reader.m.get_stats())
    finally:
        writer.close()
        reader.close()


def test_the_tier_takes_the_plans_chunks_and_sends_its_chunk_geometry(model_dir, daemon, monkeypatch):
    hits, sent, c = _lookup(model_dir, daemon, monkeypatch,
                            {"recompute_tokens_per_s": 5e4, "recompute_quad_s": 1e-9}, cut=3)
    assert hits == 3, "chunks past the plan's cut are misses"
    assert sent and sent[0]["page_tokens"] == BLOCK and sent[0]["keys_per_page"] == 1
    assert sent[0]["tokens_per_s"] == 5e4 and sent[0]["quad_s"] == 1e-9
    assert sent[0]["via"] in ("region", "copy") and sent[0]["start_tokens"] == 0
    assert c.get("vllm:kv_offload_kvnode_plan_cut_keys") == 3


def test_the_tier_without_a_cost_sends_none_and_hits_every_held_chunk(model_dir, daemon, monkeypatch):
    hits, sent, c = _lookup(model_dir, daemon, monkeypatch, {}, cut=1)
    assert hits == 6 and sent == []
    assert not c.get("vllm:kv_offload_kvnode_plan_cut_keys")


def _real(model_dir, daemon, monkeypatch, tier):
    monkeypatch.delenv("KVNODE_RECOMPUTE_TOKENS_PER_S", raising=False)
    writer = Engine(model_dir, daemon.socket)
    reader = Engine(model_dir, daemon.socket, tier=tier)
    try:
        keys, rows, _ = keys_and_rows(6)
        writer.store(keys, rows)
        ctx = ReqContext(req_id="r")
        with reader.m.lock:
            reader.m.on_new_request(ctx)
        hits, _, _ = reader.lookup(keys, ctx)
        return hits, counters(reader.m.get_stats()), Connection(daemon.socket).stats()["plans"]
    finally:
        writer.close()
        reader.close()


def test_the_daemons_own_plan_cuts_the_tier_when_recompute_is_absurdly_fast(model_dir, daemon, monkeypatch):
    """No seam: the daemon plans. Recomputing a chunk at 10^12 tokens/s is faster than even a
    DRAM read, so the plan fetches nothing and every chunk misses; at 1 token/s it takes all."""
    hits, c, plans = _real(model_dir, daemon, monkeypatch, {"recompute_tokens_per_s": 1e12})
    assert hits == 0, f"the daemon's cut was not taken ({plans})"
    assert plans["slower"] >= 1 and c.get("vllm:kv_offload_kvnode_plan_cut_keys") == 6
    hits, c, plans = _real(model_dir, daemon, monkeypatch, {"recompute_tokens_per_s": 1.0})
    assert hits == 6 and plans["all"] >= 1 and not c.get("vllm:kv_offload_kvnode_plan_cut_keys")
