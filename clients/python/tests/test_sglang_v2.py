"""The v2 interface (register_mem_host_pool_v2, batch_exists_v2 / get_v2 / set_v2 with PoolTransfer)
against sglang 0.5.23's own host pools and a real daemon.

The hit-policy verdicts are checked against SGLang's own HiCacheFile backend holding the very
same pages: both must answer every batch_exists_v2 alike.
"""

import pytest
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

import sglang_pools as sp
from kvnode.pool import UnsupportedPool
from kvnode.sglang.backend import KvnodeStorage
from test_sglang_backend import config, hashes


def backend(daemon, kv_pool, pools, **kw):
    s = KvnodeStorage(config(daemon, **kw), {})
    s.register_mem_pool_host(kv_pool)
    s.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    for name, p in pools.items():
        s.register_mem_host_pool_v2(p, name)
    return s


def xfer(name, pool, keys, pages, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(name=name, host_indices=sp.indices(pool, pages), keys=list(keys), hit_policy=policy)


def test_every_pool_has_its_own_namespace_so_equal_keys_never_alias(daemon):
    kv, swa, draft = sp.mha_pool(), sp.mha_pool(pool_label="swa"), sp.mha_pool(pool_label="draft")
    mamba = sp.mamba_pool()
    s = backend(daemon, kv, {PoolName.SWA: swa, PoolName.DRAFT: draft, PoolName.MAMBA: mamba})
    assert len({b.ns for b in s._pools.values()}) == 4
    for i, p in enumerate((kv, swa, draft)):
        sp.fill_random(p, 10 + i)
    sp.mamba_fill_random(mamba, 13)
    keys = hashes(3, seed=3)
    res = s.batch_set_v2([xfer(PoolName.KV, kv, keys, [0, 1, 2]), xfer(PoolName.SWA, swa, keys, [0, 1, 2]),
                          xfer(PoolName.DRAFT, draft, keys, [0, 1, 2]),
                          xfer(PoolName.MAMBA, mamba, keys, [4, 5, 6])])
    assert all(v == [True] * 3 for v in res.values()), res
    got = s.batch_get_v2([xfer(PoolName.KV, kv, keys, [7, 8, 9]), xfer(PoolName.SWA, swa, keys, [7, 8, 9]),
                          xfer(PoolName.DRAFT, draft, keys, [7, 8, 9]),
                          xfer(PoolName.MAMBA, mamba, keys, [10, 11, 12])])
    assert all(v == [True] * 3 for v in got.values()), got
    for p in (kv, swa, draft):
        for src, dst in zip([0, 1, 2], [7, 8, 9]):
            assert sp.page_bytes(p, dst) == sp.page_bytes(p, src)
    for src, dst in zip([4, 5, 6], [10, 11, 12]):
        assert sp.page_bytes(mamba, dst) == sp.page_bytes(mamba, src)
    assert sp.page_bytes(swa, 7) != sp.page_bytes(kv, 7), "pools hold different bytes under one key"
    # v1 on the KV anchor reads what v2 stored under PoolName.KV (one namespace).
    assert s.batch_get_v1(keys, sp.indices(kv, [13, 14, 15])) == [True] * 3
    assert sp.page_bytes(kv, 13) == sp.page_bytes(kv, 0)
    s.close()


def test_mamba_state_round_trips_zero_copy_through_both_of_its_memfds(daemon):
    kv, mamba = sp.mha_pool(), sp.mamba_pool()
    s = backend(daemon, kv, {PoolName.MAMBA: mamba})
    b = s._pools["mamba"]
    assert len(b.extents) == 2 and b.seg_n == 2, "temporal and conv state: two allocations"
    sp.mamba_fill_random(mamba, 4)
    keys = hashes(2, seed=4)
    assert s.batch_set_v2([xfer(PoolName.MAMBA, mamba, keys, [1, 2])]) == {PoolName.MAMBA: [True, True]}
    want = [sp.page_bytes(mamba, p) for p in (1, 2)]
    for r in sp.mamba_raw(mamba):
        r.zero_()
    assert s.batch_get_v2([xfer(PoolName.MAMBA, mamba, keys, [5, 9])]) == {PoolName.MAMBA: [True, True]}
    assert [sp.page_bytes(mamba, p) for p in (5, 9)] == want
    regions = s._conn().stats()["regions"]
    assert regions["attached_guarded"] == 3, regions  # KV + Mamba's two memfds on this connection
    s.close()


# presence per pool for 6 KV pages: which pages each pool holds
PRESENCE = [
    ({}, {}),
    ({PoolName.MAMBA: [2, 5]}, {PoolName.MAMBA: (PoolHitPolicy.TRAILING_PAGES, 1)}),
    ({PoolName.MAMBA: [1, 2, 5]}, {PoolName.MAMBA: (PoolHitPolicy.TRAILING_PAGES, 2)}),
    ({PoolName.DRAFT: [0, 1, 2, 3]}, {PoolName.DRAFT: (PoolHitPolicy.ALL_PAGES, 6)}),
    ({PoolName.DRAFT: [0, 1, 2, 3, 4, 5], PoolName.MAMBA: [3]},
     {PoolName.DRAFT: (PoolHitPolicy.ALL_PAGES, 6), PoolName.MAMBA: (PoolHitPolicy.TRAILING_PAGES, 1)}),
    ({PoolName.SWA: [0, 2, 3, 4], PoolName.MAMBA: [4, 5]},
     {PoolName.SWA: (PoolHitPolicy.TRAILING_PAGES, 3), PoolName.MAMBA: (PoolHitPolicy.TRAILING_PAGES, 1)}),
]


@pytest.mark.parametrize("stored,asked", PRESENCE)
def test_exists_v2_hit_policies_agree_with_sglangs_own_file_backend(daemon, tmp_path, stored, asked):
    kv, swa, draft, mamba = sp.mha_pool(), sp.mha_pool(pool_label="swa"), sp.mha_pool(pool_label="draft"), sp.mamba_pool()
    pools = {PoolName.SWA: swa, PoolName.DRAFT: draft, PoolName.MAMBA: mamba}
    s = backend(daemon, kv, pools)
    f = HiCacheFile(config(daemon), file_path=str(tmp_path / "file"))
    f.register_mem_pool_host(kv)
    for name, p in {PoolName.KV: kv, **pools}.items():
        f.register_mem_host_pool_v2(p, name)
    keys = hashes(8, seed=len(stored) + 31 * len(asked))
    kv_pages = 6
    for store in (s, f):
        assert all(store.batch_set_v2([xfer(PoolName.KV, kv, keys[:kv_pages], range(kv_pages))])[PoolName.KV])
        for name, pages in stored.items():
            put = [PoolTransfer(name=name, host_indices=sp.indices(pools[name], [pg]), keys=[keys[pg]])
                   for pg in pages]
            assert all(all(v) for t in put for v in store.batch_set_v2([t]).values())
    transfers = [PoolTransfer(name=n, keys=keys[kv_pages - w:kv_pages], hit_policy=pol)
                 for n, (pol, w) in asked.items()]
    ours = s.batch_exists_v2(keys, transfers)
    theirs = f.batch_exists_v2(keys, transfers)
    assert (ours.kv_hit_pages, ours.restorable_prefix_pages) == (theirs.kv_hit_pages, theirs.restorable_prefix_pages)
    assert ours.extra_pool_hit_pages == theirs.extra_pool_hit_pages, (ours, theirs)
    assert ours.kv_hit_pages <= kv_pages
    s.close()


def test_unsupported_policy_and_unregistered_pool_are_clear_errors(daemon):
    kv = sp.mha_pool()
    s = backend(daemon, kv, {})
    keys = hashes(2, seed=1)
    assert all(s.batch_set_v1(keys, sp.indices(kv, [0, 1])))
    with pytest.raises(ValueError, match="never registered"):
        s.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)])
    s.register_mem_host_pool_v2(sp.mha_pool(pool_label="indexer"), PoolName.INDEXER)
    with pytest.raises(ValueError, match="hit policy 'block_groups'"):
        s.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                              hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    s.close()


def test_a_pool_without_a_zero_copy_page_layout_is_refused_at_registration(daemon):
    s = KvnodeStorage(config(daemon), {})
    with pytest.raises(UnsupportedPool, match="'swa'.*layout 'page_unified'.*Unsupported layout"):
        s.register_mem_host_pool_v2(sp.mha_pool("page_unified", pool_label="swa"), PoolName.SWA)
    s.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_sglang_mla_pool_has_one_writer_and_every_rank_reads_its_bytes(daemon, layout):
    w_pool, r_pool = sp.mla_pool(layout), sp.mla_pool(layout)
    sp.fill_random(w_pool, 21)
    writer = backend(daemon, w_pool, {}, mla=True, tp_rank=0, tp_size=2)
    reader = backend(daemon, r_pool, {}, mla=True, tp_rank=1, tp_size=2)
    keys = hashes(3, seed=21)
    assert reader.batch_set_v1(keys, sp.indices(r_pool, [0, 1, 2])) == [True] * 3
    assert writer.batch_exists(keys) == 0, "the non-writer rank stored"
    assert writer.batch_set_v1(keys, sp.indices(w_pool, [0, 1, 2])) == [True] * 3
    assert reader.batch_get_v1(keys, sp.indices(r_pool, [5, 6, 7])) == [True] * 3
    assert [sp.page_bytes(r_pool, p) for p in (5, 6, 7)] == [sp.page_bytes(w_pool, p) for p in (0, 1, 2)]
    for s in (writer, reader):
        s.close()


def test_mla_replicated_pools_have_one_writer_but_mamba_state_is_per_rank(daemon):
    kv0, kv1, m0, m1 = sp.mla_pool(), sp.mla_pool(), sp.mamba_pool(), sp.mamba_pool()
    r0 = backend(daemon, kv0, {PoolName.MAMBA: m0}, mla=True, tp_rank=0, tp_size=2)
    r1 = backend(daemon, kv1, {PoolName.MAMBA: m1}, mla=True, tp_rank=1, tp_size=2)
    assert r0._pools["kv"].ns == r1._pools["kv"].ns, "MLA KV is one set of bytes for every rank"
    assert r0._pools["mamba"].ns != r1._pools["mamba"].ns, "Mamba state is sharded per TP rank"
    sp.fill_random(kv1, 1)
    sp.mamba_fill_random(m1, 2)
    keys = hashes(2, seed=2)
    res = r1.batch_set_v2([xfer(PoolName.KV, kv1, keys, [0, 1]), xfer(PoolName.MAMBA, m1, keys, [0, 1])])
    assert res == {PoolName.KV: [True, True], PoolName.MAMBA: [True, True]}
    assert r1.batch_exists(keys) == 0, "a non-writer rank stored replicated KV"
    assert r1.batch_get_v2([xfer(PoolName.MAMBA, m1, keys, [3, 4])]) == {PoolName.MAMBA: [True, True]}
    assert r0.batch_get_v2([xfer(PoolName.MAMBA, m0, keys, [3, 4])]) == {PoolName.MAMBA: [False, False]}
    for r in (r0, r1):
        r.close()
