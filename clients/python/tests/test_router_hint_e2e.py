"""A Dynamo `kv.fetch` hint in an SGLang /generate body ends with worker B's host pool holding
worker A's pages byte-identical, pulled daemon to daemon through kvnode.

Two real daemons (A serves peers; B may pull from A and from a port nobody holds), SGLang 0.5.23
with kvnode's seam applied, SGLang's own request path and prefetch threads (tests/sglang_stack.py
says which objects are built without their constructors), SGLang's own host pools. Without the
seam the hint never leaves the Req and these tests fail: B loads nothing.
"""

import json
import os
import signal
import socket
import time

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

import sglang_pools as sp
import sglang_stack as stack
from test_sglang_backend import storage

PAGE = 4


def tokens(n_pages, seed):
    return [(seed * 7919 + i * 104729) % 150_000 for i in range(n_pages * PAGE)]


def prefetchable(toks):
    """Tokens SGLang will take from storage: the last token is always computed, so the prefix
    stops at the last whole page before it (Req._compute_max_prefix_len)."""
    return (len(toks) - 1) // PAGE * PAGE


def envelope(port, keys, **payload):
    """What Dynamo's router sends: the source's control endpoint and the pages it holds, as the
    signed 64-bit hashes SGLang's KV events publish."""
    return {"protocol_version": "0.1", "message_id": "m-1", "actions": [{
        "action_id": "a-1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": f"tcp://127.0.0.1:{port}",
                    "block_hashes": [hash_str_to_int64(k) for k in keys], "mode": "copy", **payload}}]}


def body(toks, hints):
    return json.dumps({"input_ids": toks, "sampling_params": {"max_new_tokens": 1},
                       "kv_hints": hints}).encode()


def request(raw, headers=None):
    return stack.to_req(stack.tokenize(stack.request_from_http(raw, headers)))


@pytest.fixture
def workers(pair):
    """Worker A (its pages stored through its own daemon) and worker B, each with SGLang's own
    shm host pool and controller threads."""
    a_daemon, pa, b_daemon, dead = pair
    a_pool, b_pool = sp.mha_pool("page_first", pages=64, page_size=PAGE), sp.mha_pool("page_first", pages=64, page_size=PAGE)
    sp.fill_random(a_pool, 5)
    a, b = storage(a_daemon, a_pool), storage(b_daemon, b_pool)
    wb = stack.Worker(b, b_pool)
    yield {"a": a, "a_pool": a_pool, "b": b, "b_pool": b_pool, "wb": wb, "pa": pa, "dead": dead,
           "a_daemon": a_daemon}
    wb.close()
    a.close()
    b.close()


def store_on_a(w, toks, first_page):
    keys = get_hash_str(toks, None, page_size=PAGE)
    pages = list(range(first_page, first_page + len(keys)))
    assert w["a"].batch_set_v1(keys, sp.indices(w["a_pool"], pages)) == [True] * len(keys)
    return keys, pages


def loaded_pages(w, req):
    """B's host pages the finished prefetch wrote, in page order."""
    op_indices = w["wb"].tree.ongoing_prefetch[req.cache_request_handle].operation.host_indices
    return [int(i) // PAGE for i in op_indices[::PAGE]]


def test_hint_in_the_generate_body_pulls_a_pages_into_b_host_pool(workers):
    w = workers
    toks = tokens(8, seed=1)
    keys, a_pages = store_on_a(w, toks, 0)
    assert w["b"].batch_exists(keys) == 0, "B holds nothing before the hint"

    req = request(body(toks, envelope(w["pa"], keys)))
    assert type(req.kv_hints).__name__ == "KvHintsEnvelope"
    assert w["wb"].prefetch(req) == prefetchable(toks) == 28, "B loaded 7 pages through A's daemon"
    b_pages = loaded_pages(w, req)
    assert len(b_pages) == 7
    for a_page, b_page in zip(a_pages, b_pages):
        assert sp.page_bytes(w["b_pool"], b_page) == sp.page_bytes(w["a_pool"], a_page)
    assert w["b"].batch_exists(keys) == 7, "the pulled pages are now B's local hits"


def test_without_a_hint_b_prefetch_finds_nothing(workers):
    w = workers
    toks = tokens(4, seed=2)
    store_on_a(w, toks, 10)
    assert w["wb"].prefetch(request(body(toks, None))) == 0


def test_batched_requests_index_their_own_hints(workers):
    w = workers
    t0, t1 = tokens(3, seed=3), tokens(3, seed=4)
    k0, _ = store_on_a(w, t0, 20)
    store_on_a(w, t1, 30)
    raw = json.dumps({"input_ids": [t0, t1], "sampling_params": {"max_new_tokens": 1},
                      "kv_hints": [envelope(w["pa"], k0), None]}).encode()
    batch = stack.request_from_http(raw)
    r0, r1 = (stack.to_req(stack.tokenize(batch[i])) for i in range(2))
    assert w["wb"].prefetch(r0) == prefetchable(t0)
    assert w["wb"].prefetch(r1) == 0, "the second item carries no hint"


def test_router_token_gate_keeps_only_the_routers_hints(workers, monkeypatch):
    w = workers
    from sglang.srt.entrypoints import http_server

    assert hasattr(http_server, "gate_kv_hints"), "the seam's /generate gate is missing"
    monkeypatch.setenv("SGLANG_KV_HINTS_TOKEN", "s3cret-router-token")
    t_pub, t_router = tokens(3, seed=5), tokens(3, seed=6)
    k_pub, _ = store_on_a(w, t_pub, 40)
    k_router, _ = store_on_a(w, t_router, 50)
    public = request(body(t_pub, envelope(w["pa"], k_pub)), {"x-sglang-kv-hints-token": "guess"})
    assert public.kv_hints is None
    assert w["wb"].prefetch(public) == 0, "a public client's hint must not steer a pull"
    routed = request(body(t_router, envelope(w["pa"], k_router)),
                     {"x-sglang-kv-hints-token": "s3cret-router-token"})
    assert w["wb"].prefetch(routed) == prefetchable(t_router)


def test_malformed_hints_fail_closed(workers):
    w = workers
    toks = tokens(3, seed=7)
    keys, _ = store_on_a(w, toks, 60)
    # An envelope that is not one is refused where the request enters (SGLang's decoder).
    with pytest.raises(ValueError, match="Malformed kv_hints envelope"):
        stack.request_from_http(body(toks, {"protocol_version": "0.1", "actions": "kv.fetch"}))
    # A well-formed envelope whose kv.fetch payload is not: kvnode ignores it, nothing is pulled.
    bad = envelope(w["pa"], keys)
    bad["actions"][0]["payload"]["block_hashes"] = ["not-a-hash"]
    assert w["wb"].prefetch(request(body(toks, bad))) == 0
    other = envelope(w["pa"], keys)
    other["actions"][0]["payload"]["source_control_endpoint"] = "udp://127.0.0.1:1"
    assert w["wb"].prefetch(request(body(toks, other))) == 0
    # Well formed, but naming an endpoint B's daemon does not authorize: never dialled. A real
    # listener holds that endpoint and counts the connections it was offered: none.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(16)
        lsn.setblocking(False)
        port = lsn.getsockname()[1]
        assert w["wb"].prefetch(request(body(toks, envelope(port, keys)))) == 0
        assert w["b"].batch_exists(keys) == 0
        time.sleep(0.2)  # a background dial, had one started, would be queued by now
        with pytest.raises(BlockingIOError):
            lsn.accept()


def _limit(b, pages):
    t = b.daemon_timeouts
    return t["base_s"] + t["per_page_s"] * pages + 1.0


def _untouched(w, before):
    assert sp.raw(w["b_pool"]).sum().item() == before, "a failed pull wrote into B's host pool"


def test_dead_peer_degrades_to_recompute_within_the_declared_timeout(workers):
    w = workers
    toks = tokens(4, seed=8)
    keys, _ = store_on_a(w, toks, 0)
    before = sp.raw(w["b_pool"]).sum().item()
    req = request(body(toks, envelope(w["dead"], keys)))
    t0 = time.perf_counter()
    got = w["wb"].prefetch(req)
    took = time.perf_counter() - t0
    assert got == 0
    assert took < _limit(w["b"], len(keys)), f"dead peer cost {took:.2f}s"
    _untouched(w, before)


def _wait_stopped(pid):
    """Until every thread of `pid` is in the stopped state (SIGSTOP is asynchronous)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = {open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                  for t in os.listdir(f"/proc/{pid}/task")}
        if states == {"T"}:
            return
        time.sleep(0.005)
    raise AssertionError(f"daemon A did not stop: thread states {states}")


def test_frozen_peer_degrades_to_recompute_within_the_declared_timeout(workers):
    w = workers
    warm = tokens(3, seed=9)
    wk, _ = store_on_a(w, warm, 12)
    assert w["wb"].prefetch(request(body(warm, envelope(w["pa"], wk)))) == prefetchable(warm)
    toks = tokens(4, seed=10)
    keys, _ = store_on_a(w, toks, 16)
    before = sp.raw(w["b_pool"]).sum().item()
    pid = w["a_daemon"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_stopped(pid)
        req = request(body(toks, envelope(w["pa"], keys)))
        t0 = time.perf_counter()
        got = w["wb"].prefetch(req)
        took = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert got == 0
    assert took < _limit(w["b"], len(keys)), f"frozen peer cost {took:.2f}s"
    _untouched(w, before)


def test_hints_reach_v2_pools_mamba_state_is_pulled_too(pair):
    """batch_exists_v2 / batch_get_v2 with the hint SGLang's hybrid controller now passes: B's
    Mamba pool gets A's state pages (its own namespace on both daemons)."""
    from sglang.srt.mem_cache.hicache_storage import storage_extra_info  # the seam's

    a_daemon, pa, b_daemon, _ = pair
    pools = {n: (sp.mha_pool(page_size=PAGE), sp.mamba_pool()) for n in "ab"}
    stores = {}
    for n, d in (("a", a_daemon), ("b", b_daemon)):
        kv, mamba = pools[n]
        s = storage(d, kv)
        s.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        stores[n] = s
    kv_a, mamba_a = pools["a"]
    sp.fill_random(kv_a, 1)
    sp.mamba_fill_random(mamba_a, 2)
    toks = tokens(4, seed=11)
    keys = get_hash_str(toks, None, page_size=PAGE)
    res = stores["a"].batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=sp.indices(kv_a, range(4)), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=sp.indices(mamba_a, [7]), keys=keys[-1:])])
    assert all(all(v) for v in res.values()), res
    info = storage_extra_info(None, stack.request_from_http(body(toks, envelope(pa, keys))).kv_hints)
    trailing = [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    b = stores["b"]
    assert b.batch_exists_v2(keys, trailing).kv_hit_pages == 0, "nothing on B without the hint"
    verdict = b.batch_exists_v2(keys, trailing, info)
    assert verdict.kv_hit_pages == 4 and verdict.restorable_prefix_pages == [4], verdict
    kv_b, mamba_b = pools["b"]
    got = b.batch_get_v2([
        PoolTransfer(name=PoolName.KV, host_indices=sp.indices(kv_b, range(8, 12)), keys=keys),
        PoolTransfer(name=PoolName.MAMBA, host_indices=sp.indices(mamba_b, [3]), keys=keys[-1:])], info)
    assert got == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
    assert [sp.page_bytes(kv_b, p) for p in range(8, 12)] == [sp.page_bytes(kv_a, p) for p in range(4)]
    assert sp.page_bytes(mamba_b, 3) == sp.page_bytes(mamba_a, 7)
    for s in stores.values():
        s.close()


def test_hint_reaches_a_kv_indexed_side_pool_through_the_hybrid_controller(pair):
    """A DSA-style side pool indexed like KV (SidecarPoolSpec(indexer, indices_from_pool=kv)):
    SGLang's controller asks batch_exists_v2 and reads the side pool with batch_get_v2, both with
    the hint; B ends with A's KV and side-pool pages."""
    from sglang.srt.mem_cache.hicache_storage import SidecarPoolSpec

    a_daemon, pa, b_daemon, _ = pair
    pools = {n: (sp.mha_pool(pages=32, page_size=PAGE), sp.mha_pool(pages=32, page_size=PAGE, pool_label="indexer"))
             for n in "ab"}
    stores = {}
    for n, d in (("a", a_daemon), ("b", b_daemon)):
        s = storage(d, pools[n][0])
        s.register_mem_host_pool_v2(pools[n][1], PoolName.INDEXER)
        stores[n] = s
    kv_a, idx_a = pools["a"]
    sp.fill_random(kv_a, 3)
    sp.fill_random(idx_a, 4)
    toks = tokens(5, seed=12)
    keys = get_hash_str(toks, None, page_size=PAGE)
    put = [PoolTransfer(name=n, host_indices=sp.indices(p, range(5)), keys=keys)
           for n, p in ((PoolName.KV, kv_a), (PoolName.INDEXER, idx_a))]
    assert all(all(v) for v in stores["a"].batch_set_v2(put).values())
    kv_b, idx_b = pools["b"]
    wb = stack.Worker(stores["b"], kv_b, {PoolName.INDEXER: idx_b},
                      [SidecarPoolSpec(PoolName.INDEXER, PoolName.KV, PoolHitPolicy.ALL_PAGES)])
    try:
        req = request(body(toks, envelope(pa, keys)))
        assert wb.prefetch(req) == prefetchable(toks) == 16
        op = wb.tree.ongoing_prefetch[req.cache_request_handle].operation
        assert [t.name for t in op.pool_transfers] == [PoolName.INDEXER]
        b_pages = [int(i) // PAGE for i in op.host_indices[::PAGE]]
        for a_page, b_page in zip(range(4), b_pages):
            assert sp.page_bytes(kv_b, b_page) == sp.page_bytes(kv_a, a_page)
            assert sp.page_bytes(idx_b, b_page) == sp.page_bytes(idx_a, a_page)
    finally:
        wb.close()
        for s in stores.values():
            s.close()
