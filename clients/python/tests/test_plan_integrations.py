"""Each integration honours the daemon's fetch plan (issue 41), with the plan injected into real
daemons' `Exists` answers: the SGLang backend (v1 batch_exists, v2 batch_exists_v2), the vLLM
connector's lookup service (the vLLM tier: tests_vllm/test_tier_plans.py). A configured cost is
sent with the engine's own page geometry and the plan's `keys` replaces the count; without a
cost nothing is sent and the count stands. The daemon's own plans (a slow NVMe tier cut, a fast
one taken) are in test_plan_e2e.py.

The seam: `Connection.call` is wrapped so that an `Exists` carrying `recompute` comes back with a
plan cutting at `cut` keys, whatever the daemon answered; every cost sent is recorded.

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_plan_integrations.py`.
"""

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName

import sglang_pools as sp
from kvnode.common import NamespaceSpec
from kvnode.vllm.lookup import LookupService
from kvnode.wire import Connection
from test_sglang_backend import hashes, storage
from test_sglang_v2 import backend, xfer

FAST = {"recompute_tokens_per_s": 5e4, "recompute_quad_s": 1e-9}


class Planner:
    """Injects a plan cutting at `cut` keys into every `Exists` answer that was asked with a cost."""

    def __init__(self, monkeypatch, cut: int):
        self.cut, self.sent = cut, []
        real = Connection.call

        def call(conn, op, *a, **kw):
            name, body, data = real(conn, op, *a, **kw)
            ex = op.get("Exists") if isinstance(op, dict) else None
            if ex is not None and ex.get("recompute"):
                self.sent.append(ex["recompute"])
                keys = min(self.cut, len(ex["keys"]))
                body = dict(body, plan={"keys": keys, "runs": [{"source": "dram", "keys": keys}],
                                        "fetch_s": 0.001, "recompute_s": 0.002, "reason": "slower",
                                        "cut_by": "nvme", "available": body["count"], "note": "injected"})
            return name, body, data

        monkeypatch.setattr(Connection, "call", call)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("KVNODE_RECOMPUTE_TOKENS_PER_S", raising=False)
    monkeypatch.delenv("KVNODE_RECOMPUTE_QUAD_S", raising=False)


def _stored(daemon, pool, n, seed, **extra):
    s = storage(daemon, pool, **extra)
    sp.fill_random(pool, seed)
    keys = hashes(n, seed=seed)
    assert s.batch_set_v1(keys, sp.indices(pool, range(n))) == [True] * n
    return s, keys


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglang_v1_takes_the_plans_pages_and_sends_its_page_geometry(daemon, monkeypatch, no_env, layout):
    pool = sp.mha_pool(layout)
    s, keys = _stored(daemon, pool, 6, 21, **FAST)
    b = s._pools["kv"]
    plan = Planner(monkeypatch, cut=3 * b.seg_n + (1 if b.seg_n > 1 else 0))
    assert s.batch_exists(keys) == 3, "the plan's keys, cut down to whole pages"
    rc = plan.sent[-1]
    assert (rc["page_tokens"], rc["keys_per_page"], rc["start_tokens"]) == (4, b.seg_n, 0)
    assert rc["tokens_per_s"] == 5e4 and rc["quad_s"] == 1e-9 and rc["via"] == "region"
    # SGLang holds two pages already (prefix_keys): the cost starts after their tokens.
    info = HiCacheStorageExtraInfo(prefix_keys=["00" * 32, "11" * 32])
    assert s.batch_exists(keys, info) == 3
    assert plan.sent[-1]["start_tokens"] == 8
    assert s.last_plan.reason == "slower"
    s.close()


def test_sglang_without_a_cost_sends_none_and_counts_every_page(daemon, monkeypatch, no_env):
    s, keys = _stored(daemon, sp.mha_pool(), 6, 22)
    plan = Planner(monkeypatch, cut=1)
    assert s.recompute is None
    assert s.batch_exists(keys) == 6
    assert plan.sent == [] and s.last_plan is None
    s.close()


def test_sglang_takes_its_cost_from_the_environment(daemon, monkeypatch, no_env):
    monkeypatch.setenv("KVNODE_RECOMPUTE_TOKENS_PER_S", "1234")
    s, keys = _stored(daemon, sp.mha_pool(), 4, 23)
    plan = Planner(monkeypatch, cut=2 * s._pools["kv"].seg_n)
    assert s.batch_exists(keys) == 2
    assert plan.sent[-1]["tokens_per_s"] == 1234.0 and plan.sent[-1]["quad_s"] == 0.0
    s.close()


def test_sglang_v2_cuts_every_pool_at_the_plan(daemon, monkeypatch, no_env):
    kv, swa = sp.mha_pool(), sp.mha_pool(pool_label="swa")
    s = backend(daemon, kv, {PoolName.SWA: swa}, **FAST)
    keys = hashes(5, seed=24)
    res = s.batch_set_v2([xfer(PoolName.KV, kv, keys, range(5)), xfer(PoolName.SWA, swa, keys, range(5))])
    assert all(v == [True] * 5 for v in res.values())
    plan = Planner(monkeypatch, cut=2 * s._pools["kv"].seg_n)
    out = s.batch_exists_v2(keys, [xfer(PoolName.SWA, swa, keys, range(5), PoolHitPolicy.ALL_PAGES)])
    assert out.kv_hit_pages == 2 and out.restorable_prefix_pages == [1, 2], out
    assert out.extra_pool_hit_pages[PoolName.SWA] == 2, "the SWA pool was asked only for the planned pages"
    assert len(plan.sent) == 1, "only the KV pool's lookup carries the cost"
    s.close()


def _lookup_service(daemon, recompute, nseg=2):
    spec = NamespaceSpec(model="plan-vllm", page_size=16, segments=(4096,) * nseg)
    svc = LookupService(lambda: Connection(daemon.socket), lambda c: c.register(spec)["ns"], nseg, 1.0,
                        recompute=recompute, block_tokens=16, via="gpu")
    c = Connection(daemon.socket)
    ns = c.register(spec)["ns"]
    return svc, c, ns


def _answer(svc, req, digests):
    lk = svc.submit(req, digests, None)
    assert lk.done.wait(10)
    return lk


def test_vllm_lookup_takes_the_plans_blocks_and_sends_its_block_geometry(daemon, monkeypatch, no_env):
    from kvnode.plan import RecomputeCost
    svc, c, ns = _lookup_service(daemon, RecomputeCost(5e4, 1e-9))
    digests = [bytes([i + 1]) * 32 for i in range(6)]
    keys = [[d, s] for d in digests for s in range(2)]
    assert c.put(ns, keys, [b"x" * 4096] * len(keys)) == ["Stored"] * len(keys)
    plan = Planner(monkeypatch, cut=7)
    lk = _answer(svc, "r1", digests)
    assert lk.blocks == 3, "7 keys of 2 per block: 3 whole blocks"
    assert lk.plan.reason == "slower"
    assert plan.sent[-1] == {"page_tokens": 16, "keys_per_page": 2, "tokens_per_s": 5e4, "quad_s": 1e-9,
                             "start_tokens": 0, "via": "gpu"}
    svc.close()
    c.close()


def test_vllm_lookup_without_a_cost_is_unchanged(daemon, monkeypatch, no_env):
    svc, c, ns = _lookup_service(daemon, None)
    digests = [bytes([i + 1]) * 32 for i in range(4)]
    keys = [[d, s] for d in digests for s in range(2)]
    c.put(ns, keys, [b"x" * 4096] * len(keys))
    plan = Planner(monkeypatch, cut=1)
    lk = _answer(svc, "r1", digests)
    assert lk.blocks == 4 and lk.plan is None and plan.sent == []
    svc.close()
    c.close()


def test_vllm_connector_config_turns_plans_on_and_the_environment_wins(monkeypatch, no_env):
    from kvnode.plan import RecomputeCost
    from kvnode.vllm.config import ConfigError, KvnodeVllmConfig
    assert KvnodeVllmConfig.parse({}).recompute() is None
    assert KvnodeVllmConfig.parse(FAST).recompute() == RecomputeCost(5e4, 1e-9)
    with pytest.raises(ConfigError, match="recompute_tokens_per_s"):
        KvnodeVllmConfig.parse({"recompute_tokens_per_s": -1})
    monkeypatch.setenv("KVNODE_RECOMPUTE_TOKENS_PER_S", "0")
    assert KvnodeVllmConfig.parse(FAST).recompute() is None, "the environment turns plans off"
