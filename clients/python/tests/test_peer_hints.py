"""Two daemons, two SGLang "workers": a router hint naming worker A's daemon makes worker B's
`batch_get_v1` pull A's pages byte-identical into B's host pool; a hint naming a dead daemon
degrades to a miss within the declared timeout and writes nothing into B's host pages.

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_peer_hints.py`.
"""

import time

import pytest

import sglang_pools as sp
from test_sglang_backend import hashes, storage


def router_hint(port: int, keys):
    # The router's hash of a page: the first 8 bytes of its digest, big-endian.
    return {"kv_hints": {"source_control_endpoint": f"tcp://127.0.0.1:{port}",
                               "block_hashes": [int(k[:16], 16) for k in keys]}}


@pytest.mark.parametrize("shm", [True, False], ids=["zero-copy", "copy"])
def test_hinted_get_pulls_peer_pages_byte_identical_and_dead_peer_is_a_bounded_miss(pair, shm):
    a_daemon, pa, b_daemon, dead = pair
    a_pool = sp.mha_pool("page_first", pages=40, shm=True)
    b_pool = sp.mha_pool("page_first", pages=40, shm=shm)
    sp.fill_random(a_pool, 7)
    a, b = storage(a_daemon, a_pool), storage(b_daemon, b_pool)
    assert b.supports_hints, "daemon B declares a timeout model, so hints are sent"
    keys = hashes(8, seed=99)
    src, dst = list(range(8)), list(range(20, 28))
    assert a.batch_set_v1(keys, sp.indices(a_pool, src)) == [True] * 8
    assert b.batch_exists(keys) == 0, "B holds nothing before the hint"

    got = b.batch_get_v1(keys, sp.indices(b_pool, dst), extra_info=router_hint(pa, keys))
    assert got == [True] * 8
    for i in range(8):
        assert sp.page_bytes(b_pool, dst[i]) == sp.page_bytes(a_pool, src[i]), f"page {i}"
    # Pulled pages are now local hits on B, without a hint.
    assert b.batch_exists(keys) == 8

    # A hint naming a daemon that is not there: a miss, within the declared timeout.
    other = hashes(4, seed=7)
    assert a.batch_set_v1(other, sp.indices(a_pool, [8, 9, 10, 11])) == [True] * 4
    fresh = [30, 31, 32, 33]
    timeouts = b.daemon_timeouts
    limit = timeouts["base_s"] + timeouts["per_page_s"] * 4 + 1.0
    t0 = time.perf_counter()
    got = b.batch_get_v1(other, sp.indices(b_pool, fresh), extra_info=router_hint(dead, other))
    took = time.perf_counter() - t0
    assert got == [False] * 4
    assert took < limit, f"dead peer cost {took:.2f}s, declared limit {limit:.2f}s"
    for p in fresh:
        assert set(sp.page_bytes(b_pool, p)) == {0}, "nothing may enter B's host pool"
    for s in (a, b):
        s.close()
