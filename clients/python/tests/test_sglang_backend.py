"""The SGLang connector (v1 interface) against sglang 0.5.23's own host pools and a real daemon.

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests`.
"""

import logging
import os
import random
import secrets
import threading

import pytest

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

import sglang_pools as sp
from kvnode.sglang.backend import HAVE_SGLANG, KvnodeStorage
from kvnode.wire import Connection, KvnodeError

LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def config(daemon, tp_rank=0, tp_size=1, mla=False, model="qwen-test", **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name=model, extra_config={"socket": daemon.socket, "interface_v1": 1, **extra})


def storage(daemon, pool, **kw):
    s = KvnodeStorage(config(daemon, **kw), {})
    s.register_mem_pool_host(pool)
    return s


def hashes(n, seed=0):
    rng = random.Random(seed)
    return get_hash_str([rng.randrange(150_000) for _ in range(4 * n)], None, page_size=4)


def test_connector_subclasses_the_real_sglang_base_class():
    assert HAVE_SGLANG
    assert issubclass(KvnodeStorage, HiCacheStorage)
    assert KvnodeStorage.__abstractmethods__ == frozenset()


@pytest.mark.parametrize("module_path", ["kvnode.sglang.backend", "kvnode.sglang_backend"])
def test_sglang_loads_the_backend_by_its_module_path_and_by_the_old_one(daemon, module_path):
    """SGLang's own loader for `--hicache-storage-backend dynamic`, with the extra-config of
    docs/sglang.md (deployments written before the move name `kvnode.sglang_backend`)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = config(daemon, backend_name="kvnode", module_path=module_path, class_name="KvnodeStorage")
    s = StorageBackendFactory.create_backend("dynamic", cfg, None)
    try:
        assert type(s) is KvnodeStorage and s.socket_path == daemon.socket
    finally:
        s.close()


class _Tokens(list):
    extra_key = None
    cache_salt = None


@pytest.mark.parametrize("salted", [False, True])
def test_sglang_page_hashes_are_kvnode_digests(daemon, salted):
    """SGLang's storage hashes name the same pages as kvnode's own (Rust) digest chain."""
    rng = random.Random(7 + salted)
    c = Connection(daemon.socket)
    spec = {"model": "hashcheck", "dtype": "bf16", "page_size": 4, "layout": "page_first",
            "tp_rank": 0, "tp_size": 1, "tenant_salt": "", "segments": [65536]}
    ns = c.register(spec)["ns"]
    for _ in range(40):
        toks = _Tokens(rng.randrange(1 << 31) for _ in range(4 * rng.randrange(1, 9)))
        args = []
        if salted:
            toks.cache_salt = secrets.token_hex(rng.randrange(1, 8))
            args = ["--cache-salt", toks.cache_salt]
            if rng.random() < 0.5:
                toks.extra_key = "lora-" + secrets.token_hex(3)
                args += ["--extra-key", toks.extra_key]
        keys = get_storage_hash_str(toks, None, page_size=4)
        if not salted:
            assert keys == get_hash_str(list(toks), None, page_size=4)
        c.put(ns, [[bytes.fromhex(k), 0] for k in keys], [b"x"] * len(keys))
        tok_arg = ",".join(map(str, toks))
        out = daemon.cli("exists", "--model", "hashcheck", "--page-size", "4", "--tokens", tok_arg, *args)
        assert out.startswith(f"{len(keys)} of {len(keys)} "), out
        toks[-1] ^= 1  # a different last token: the last page must miss
        out = daemon.cli("exists", "--model", "hashcheck", "--page-size", "4",
                         "--tokens", ",".join(map(str, toks)), *args)
        assert out.startswith(f"{len(keys) - 1} of "), out
    c.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shm", [True, False])
def test_round_trip_into_host_pages_is_byte_exact(daemon, layout, shm, caplog):
    a_pool, b_pool = sp.mha_pool(layout, shm=shm), sp.mha_pool(layout, shm=shm)
    sp.fill_random(a_pool, 1)
    with caplog.at_level(logging.WARNING):
        a, b = storage(daemon, a_pool), storage(daemon, b_pool)
    assert a.zero_copy == shm and b.zero_copy == shm
    assert shm or '"allocator": "shm"' in caplog.text
    keys = hashes(6, seed=len(layout))
    src, dst = [1, 3, 4, 7, 8, 15], [0, 2, 5, 6, 9, 10]
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, sp.indices(a_pool, src)) == [True] * 6
    assert b.batch_exists(keys) == 6
    ask = keys[:4] + ["ab" * 32] + keys[5:]
    assert b.batch_get_v1(ask, sp.indices(b_pool, dst)) == [True] * 4 + [False, True]
    for i in (0, 1, 2, 3, 5):
        assert sp.page_bytes(b_pool, dst[i]) == sp.page_bytes(a_pool, src[i]), f"page {i}"
    assert set(sp.page_bytes(b_pool, dst[4])) == {0}, "a miss wrote into the host page"
    for s in (a, b):
        s.close()


def test_sglang_shaped_pool_is_guarded_and_shrinking_it_only_fails_its_owner(daemon):
    """SGLang 0.5.23's pool memfd (MFD_CLOEXEC only) cannot be sealed, so the daemon maps it under
    its SIGBUS guard. A pool shrunk under the daemon fails its owner's next call with an error;
    the daemon and another connector keep serving byte-exact pages."""
    a_pool, b_pool = sp.mha_pool("page_first"), sp.mha_pool("page_first")
    sp.fill_random(a_pool, 3)
    a, b = storage(daemon, a_pool), storage(daemon, b_pool)
    regions = Connection(daemon.socket).stats()["regions"]
    assert (regions["attached_guarded"], regions["attached_sealed"]) == (2, 0), regions
    keys = hashes(4, seed=5)
    assert a.batch_set_v1(keys, sp.indices(a_pool, [0, 1, 2, 3])) == [True] * 4
    want = [sp.page_bytes(a_pool, p) for p in range(4)]
    os.ftruncate(a_pool.fd, 4096)  # from here on the test must not touch a_pool's pages
    with pytest.raises(KvnodeError, match="shrank under the daemon"):
        a.batch_get_v1(keys, sp.indices(a_pool, [4, 5, 6, 7]))
    assert b.batch_get_v1(keys, sp.indices(b_pool, [4, 5, 6, 7])) == [True] * 4
    assert [sp.page_bytes(b_pool, p) for p in (4, 5, 6, 7)] == want
    assert Connection(daemon.socket).stats()["regions"]["faults"] == 1
    for s in (a, b):
        s.close()


def test_pages_written_under_one_layout_are_never_read_under_another(daemon):
    pools = {lay: sp.mha_pool(lay) for lay in LAYOUTS}
    stores = {lay: storage(daemon, p) for lay, p in pools.items()}
    keys = hashes(4, seed=99)
    sp.fill_random(pools["page_first"], 3)
    assert all(stores["page_first"].batch_set_v1(keys, sp.indices(pools["page_first"], range(4))))
    for lay in ("page_first_direct", "layer_first"):
        assert stores[lay].batch_exists(keys) == 0
        assert stores[lay].batch_get_v1(keys, sp.indices(pools[lay], range(4))) == [False] * 4
        assert set(bytes(sp.raw(pools[lay]).numpy())) == {0}
    assert stores["page_first"].batch_exists(keys) == 4


def test_tp_ranks_and_models_do_not_share_pages_but_mla_ranks_do(daemon):
    pool = sp.mha_pool("page_first")
    sp.fill_random(pool, 5)
    keys = hashes(3, seed=5)
    r0 = storage(daemon, pool, tp_rank=0, tp_size=2)
    assert all(r0.batch_set_v1(keys, sp.indices(pool, range(3))))
    assert storage(daemon, sp.mha_pool("page_first"), tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert storage(daemon, sp.mha_pool("page_first"), model="other").batch_exists(keys) == 0
    # MLA: only the storage writer (rank 0) stores; every rank reads the same blocks.
    m1_pool = sp.mha_pool("page_first")
    m1 = storage(daemon, m1_pool, mla=True, tp_rank=1, tp_size=2)
    sp.fill_random(m1_pool, 6)
    assert m1.batch_set_v1(keys, sp.indices(m1_pool, range(3))) == [True] * 3
    assert m1.batch_exists(keys) == 0, "a non-writer MLA rank stored pages"
    m0 = storage(daemon, pool, mla=True, tp_rank=0, tp_size=2)
    assert all(m0.batch_set_v1(keys, sp.indices(pool, range(3))))
    assert m1.batch_get_v1(keys, sp.indices(m1_pool, [9, 10, 11])) == [True] * 3
    assert sp.page_bytes(m1_pool, 10) == sp.page_bytes(pool, 1)


def test_clear_really_clears_and_stats_report_bandwidth(daemon):
    pool = sp.mha_pool("page_first")
    sp.fill_random(pool, 8)
    s = storage(daemon, pool)
    other = storage(daemon, sp.mha_pool("page_first"), model="kept")
    keys = hashes(5, seed=8)
    assert all(s.batch_set_v1(keys, sp.indices(pool, range(5))))
    assert all(other.batch_set_v1(keys, sp.indices(pool, range(5))))
    assert all(s.batch_get_v1(keys, sp.indices(pool, range(5, 10))))
    m = s.get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics

    assert type(m) is StorageMetrics, "SGLang's own StorageMetrics, what its collector reads"
    assert m.backup_pgs == [5] and m.prefetch_pgs == [5]
    assert m.prefetch_bandwidth[0] > 0 and m.backup_bandwidth[0] > 0
    assert s.get_stats().prefetch_pgs == []
    assert s.clear() is True
    assert s.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 5, "clear() reached another namespace"


def test_legacy_flat_page_interface_round_trips(daemon):
    import torch
    pool = sp.mha_pool("page_first")
    s = storage(daemon, pool)
    keys = hashes(2, seed=11)
    vals = [torch.randint(0, 255, (s.page_bytes,), dtype=torch.uint8) for _ in keys]
    assert s.batch_set(keys, vals)
    out = s.batch_get(keys, [torch.zeros(s.page_bytes, dtype=torch.uint8) for _ in keys])
    assert all(torch.equal(o, v) for o, v in zip(out, vals))
    assert s.get("cd" * 32, torch.zeros(s.page_bytes, dtype=torch.uint8)) is None
    assert s.batch_exists(keys) == 0, "flat pages leaked into the zero-copy namespace"


def test_concurrent_threads_each_get_exact_pages(daemon):
    src = sp.mha_pool("page_first", pages=32)
    sp.fill_random(src, 12)
    s = storage(daemon, src)
    keys = hashes(8, seed=12)
    assert all(s.batch_set_v1(keys, sp.indices(src, range(8))))
    errors = []

    def worker(t):
        try:
            for _ in range(20):
                dst = list(range(8 + 3 * t, 8 + 3 * t + 3))
                assert s.batch_get_v1(keys[t:t + 3], sp.indices(src, dst)) == [True] * 3
                assert s.batch_exists(keys) == 8
                for j, d in enumerate(dst):
                    assert sp.page_bytes(src, d) == sp.page_bytes(src, t + j)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
