"""Every lane the long-prefix section opens is closed and its KV pool freed when its arm ends,
also when the arm fails (issue 41: on the GPU the exported pools of all arms piled up until the
last arm ran out of memory). CPU, tiny model, a stand-in tier (no daemon); the torch IPC
ref-counter bookkeeping of harness/movers.py + KvPool.release with a stand-in storage."""

import pytest
import torch

from harness import movers, pool as pl, worker as wk
from harness.tier import Load


class _FakeTier:
    """DaemonTier's surface as Lane and Worker use it; `promotions()` fails when asked to."""

    opened, closed = [], []

    def __init__(self, spec, pool, router=None, client=""):
        self.spec, self.pool, self._done = spec, pool, []
        self.offload_pages = self.offload_bytes = 0
        self.offload_s = self.room_wait_s = 0.0
        self.offload_errors, self.offload_shared = [], False
        if spec.extra.get("fail_open"):
            raise RuntimeError("daemon refused")
        _FakeTier.opened.append(self)

    def lookup_and_load(self, *a, **kw):
        return Load(), []

    def offload_async(self, digests, pages):
        self._done.append(list(pages))

    def drain(self, wait=False):
        out = [p for ps in self._done for p in ps]
        self._done = []
        return out

    def promotions(self):
        if self.spec.extra.get("fail"):
            raise RuntimeError("boom")
        return 0

    @property
    def conn(self):
        return type("C", (), {"stats": staticmethod(lambda: {"tiers": []})})()

    def close(self):
        _FakeTier.closed.append(self)


def long_prefix_closes_every_lane_and_frees_every_pool_even_when_an_arm_fails(monkeypatch):
    _FakeTier.opened, _FakeTier.closed = [], []
    pools = []

    class _Pool(pl.KvPool):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            pools.append(self)

    monkeypatch.setattr(wk, "DaemonTier", _FakeTier)
    monkeypatch.setattr(wk, "KvPool", _Pool)
    t = {"sock": "unused", "kind": "dram", "mover": "copy"}
    spec = {"model": "tiny", "device": "cpu", "mover": "copy", "long_prefix": {
        "tokens": 64, "suffix": 4, "reps": 1, "mixed_dram_frac": 0.5, "plan_fit_tokens": 32,
        "paths": [
            {"name": "dram", "kind": "dram", "tier": t},
            {"name": "dram_plan", "kind": "dram", "plan": True, "tier": t},
            {"name": "broken", "kind": "dram", "tier": dict(t, extra={"fail": True})},
            {"name": "refused", "kind": "dram", "tier": dict(t, extra={"fail_open": True})},
            {"name": "peer", "kind": "peer", "source": dict(t, kind="peer"), "tier": dict(t, kind="peer")},
            {"name": "peer_refused", "kind": "peer", "source": dict(t, kind="peer"),
             "tier": dict(t, kind="peer", extra={"fail_open": True})},
        ]}}
    w = wk.Worker(spec)
    out = w.long_prefix()
    assert "boom" in out["broken"]["error"] and "refused" in out["refused"]["error"]
    assert "refused" in out["peer_refused"]["error"]
    assert "ttft_s" in out["dram"] and "ttft_s" in out["peer"] and "ttft_s" in out["dram_plan"]
    assert out["plan_cost"]["ctx_s"] > 0
    # Every lane opened was closed; every tier opened was closed; every pool was freed.
    assert out["lanes_open_after"] == [] and w.open_lanes == {}
    assert w.lanes_opened == 1 + 1 + 1 + 1 + 2 + 1  # recompute, dram, dram_plan, broken, peer x2, peer_refused src
    assert sorted(map(id, _FakeTier.opened)) == sorted(map(id, _FakeTier.closed)) and len(_FakeTier.opened) == 6
    assert len(pools) == w.lanes_opened + 2  # + the two pools whose tier was refused
    assert all(p.released and p.t is None for p in pools)


def a_pool_exported_twice_drops_both_ipc_counters_when_released(monkeypatch):
    """DmaMover exports the pool through kvnode.gpu.export_tensor once per connection; torch's
    `_share_cuda_` sets a ref counter to 1 for each, which only a torch consumer would drop.
    KvPool.release drops each (as torch's consumer does), then the tensor."""
    p = pl.KvPool(wk.CONFIGS["tiny"], 2, "cpu")
    handle = b"\x01c" + bytes(range(64))

    class _Storage:
        n = 0

        def _share_cuda_(self):
            _Storage.n += 1
            return (0, handle, 4096, 0, f"/torch_{_Storage.n}".encode(), 7 * _Storage.n, b"ev", True)

    class _T:
        is_cuda = True

        def is_contiguous(self):
            return True

        def untyped_storage(self):
            return _Storage()

        def storage_offset(self):
            return 0

        def element_size(self):
            return 2

    p.t = _T()
    from kvnode.gpu import export_tensor
    for _ in range(2):
        exp = export_tensor(movers._CountedExport(p))
        assert exp.handle == handle[2:] and exp.length == 4096
    assert p.ipc_counters == [(b"/torch_1", 7), (b"/torch_2", 14)]
    dropped = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda h, o: dropped.append((h, o))), raising=False)
    p.release()
    p.release()  # once only
    assert dropped == [(b"/torch_1", 7), (b"/torch_2", 14)]
    assert p.t is None and p.ipc_counters == []


def a_closed_lane_is_not_closed_twice():
    w = wk.Worker({"model": "tiny", "device": "cpu"})
    ln = w.lane("x", 4)
    w.close(ln)
    w.close(ln)
    assert w.open_lanes == {} and ln.pool.released
    with pytest.raises(TypeError):
        ln.pool.k(0)
