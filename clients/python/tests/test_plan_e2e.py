"""The daemon's own fetch plans reach the engine integrations (issue 41), against a real daemon
whose blocks sit on its NVMe tier (a small DRAM tier over a spill dir; the NVMe read path
measured by a promotion first, so the plan is made from figures, not a probe):

- a recompute cost absurdly fast (10^12 tokens/s) makes the daemon cut the NVMe-held prefix:
  the SGLang backend and the vLLM connector's lookup answer 0 pages (recompute it all), while
  the plain count says every page is there;
- an absurdly slow one (1 token/s) takes it all;
- without a cost the count stands and the daemon answers no plan.

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_plan_e2e.py`.
"""

import time

import pytest

import sglang_pools as sp
from conftest import Daemon
from kvnode.common import NamespaceSpec
from kvnode.plan import RecomputeCost
from kvnode.vllm.lookup import LookupService
from kvnode.wire import Connection
from test_sglang_backend import hashes, storage

FAST = {"recompute_tokens_per_s": 1e12}
SLOW = {"recompute_tokens_per_s": 1.0}
FILL = 64 << 10


@pytest.fixture
def spilling(tmp_path, monkeypatch):
    monkeypatch.delenv("KVNODE_RECOMPUTE_TOKENS_PER_S", raising=False)
    monkeypatch.delenv("KVNODE_RECOMPUTE_QUAD_S", raising=False)
    d = Daemon(tmp_path / "d", dram="16MiB", extra=("--spill-dir", str(tmp_path / "spill"),
                                                    "--spill-size", "256MiB", "--spill-engine", "psync",
                                                    "--spill-lag", "10ms"))
    yield d
    d.stop()


def _nvme_blocks(c: Connection) -> int:
    return next(t for t in c.stats()["tiers"] if t["tier"] == "nvme")["blocks"]


def _copied(c: Connection, n: int, limit_s: float = 20.0) -> None:
    """Waits until the NVMe tier holds `n` blocks (--spill-lag copies every DRAM block)."""
    t0 = time.monotonic()
    while _nvme_blocks(c) < n:
        assert time.monotonic() - t0 < limit_s, f"NVMe holds {_nvme_blocks(c)} of {n} blocks"
        time.sleep(0.01)


def _push_to_nvme(d: Daemon, tag: str, segments) -> None:
    """Copies every block to NVMe, then fills the 16 MiB DRAM tier twice over with other blocks
    of the same segment sizes (DRAM slot classes are per size; their own namespace, each batch
    copied to NVMe before the next), so every earlier block is on NVMe only; then reads some of
    the fillers back, so the daemon has measured its NVMe read path."""
    c = Connection(d.socket)
    try:
        base = _nvme_blocks(c)
        held = sum(s["blocks"] for s in c.stats()["tiers"] if s["tier"] == "dram")
        _copied(c, base + held)
        ns = c.register({"model": f"filler-{tag}", "page_size": 4, "segments": list(segments)})["ns"]
        pages = 2 * (16 << 20) // sum(segments) + 8
        keys = [[bytes([7, i % 256, i // 256]) + bytes(29), s] for i in range(pages) for s in range(len(segments))]
        per = 8 * len(segments)
        for i in range(0, len(keys), per):
            part = keys[i:i + per]
            assert c.put(ns, part, [bytes([i % 251]) * segments[k[1]] for k in part]) == ["Stored"] * len(part)
            _copied(c, base + held + i + len(part))
        assert all(b is not None for b in c.get(ns, keys[:per])), "the first fillers came back from NVMe"
        costs = {p["path"]: p for p in c.stats().get("costs") or []}
        assert costs.get("nvme_read", {}).get("samples", 0) > 0, f"NVMe read path not measured: {costs}"
    finally:
        c.close()


def _runs(d: Daemon, ns: int, keys, page_tokens: int, kpp: int):
    c = Connection(d.socket)
    try:
        body = c.call({"Exists": {"ns": ns, "keys": keys,
                                  **RecomputeCost(1.0).wire(page_tokens, kpp)}})[1]
        return body["count"], [(r["source"], r["keys"]) for r in body["plan"]["runs"]]
    finally:
        c.close()


def test_sglang_recomputes_an_nvme_prefix_when_recompute_is_faster_and_fetches_it_when_slower(spilling):
    pool = sp.mha_pool(page_size=16, head_num=8)  # page objects of 48 KiB
    sp.fill_random(pool, 41)
    plain = storage(spilling, pool)
    keys = hashes(6, seed=41)
    assert plain.batch_set_v1(keys, sp.indices(pool, range(6))) == [True] * 6
    b = plain._pools["kv"]
    _push_to_nvme(spilling, "sglang", [b.page_bytes // b.seg_n] * b.seg_n)
    count, runs = _runs(spilling, b.ns, b.keys(keys), 16, b.seg_n)
    assert count == 6 * b.seg_n and runs == [("nvme", 6 * b.seg_n)], f"not on NVMe alone: {runs}"

    fast, slow = storage(spilling, pool, **FAST), storage(spilling, pool, **SLOW)
    try:
        assert fast.batch_exists(keys) == 0, f"the plan's cut was not taken: {fast.last_plan}"
        assert fast.last_plan.reason == "slower" and fast.last_plan.cut_by == "nvme"
        assert fast.last_plan.available == 6 * b.seg_n
        assert slow.batch_exists(keys) == 6, f"the plan took less than all: {slow.last_plan}"
        assert slow.last_plan.reason == "all"
        assert plain.batch_exists(keys) == 6 and plain.last_plan is None, "no cost: the count"
        plans = Connection(spilling.socket).stats()["plans"]
        assert plans["slower"] >= 1 and plans["all"] >= 1 and plans["keys_recompute"] >= 6 * b.seg_n
    finally:
        for s in (plain, fast, slow):
            s.close()


def test_vllm_lookup_recomputes_an_nvme_prefix_when_recompute_is_faster_and_loads_it_when_slower(spilling):
    spec = NamespaceSpec(model="plan-e2e-vllm", page_size=16, segments=(FILL, FILL))
    c = Connection(spilling.socket)
    ns = c.register(spec)["ns"]
    digests = [bytes([0xA0 + i]) * 32 for i in range(6)]
    keys = [[d, s] for d in digests for s in range(2)]
    assert c.put(ns, keys, [b"v" * FILL] * len(keys)) == ["Stored"] * len(keys)
    c.close()
    _push_to_nvme(spilling, "vllm", [FILL, FILL])
    assert _runs(spilling, ns, keys, 16, 2) == (12, [("nvme", 12)])

    def blocks(cost):
        svc = LookupService(lambda: Connection(spilling.socket), lambda conn: conn.register(spec)["ns"], 2, 1.0,
                            recompute=cost, block_tokens=16, via="gpu")
        try:
            lk = svc.submit("r", digests, None)
            assert lk.done.wait(10)
            return lk.blocks, lk.plan
        finally:
            svc.close()

    n, plan = blocks(RecomputeCost(1e12))
    assert n == 0 and plan.reason == "slower" and plan.cut_by == "nvme", plan
    n, plan = blocks(RecomputeCost(1.0))
    assert n == 6 and plan.reason == "all", plan
    n, plan = blocks(None)
    assert n == 6 and plan is None
