"""Measures KvnodeStorage.batch_get_v2 (two pools, 64 x 1 MiB pages each, local hits, zero copy)
against memcpy.

Run: `KVNODE_BIN=target/release/kvnode python clients/python/bench/bench_get_v2.py [serve args]`
(with the venv from scripts/install-deps.sh). One v2 call carries two PoolTransfers: SGLang's
KV pool and a draft-KV pool, both SGLang 0.5.23's own MHATokenToKVPoolHost on its shm
allocator, each in its own kvnode namespace and memfd region. Prints GiB/s of the call and of a
same-run memcpy of the same total bytes, and the ratio.
"""

from common import GEOMETRY, measure, report, start_daemon
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

import sglang_pools as sp
from kvnode.sglang.backend import KvnodeStorage
from test_sglang_backend import config

PAGES = 64  # per pool


def main(argv) -> None:
    d = start_daemon(argv)
    try:
        kv = sp.mha_pool("page_first", pages=2 * PAGES, **GEOMETRY)
        draft = sp.mha_pool("page_first", pages=2 * PAGES, pool_label="draft", **GEOMETRY)
        for i, p in enumerate((kv, draft)):
            sp.fill_random(p, i)
        s = KvnodeStorage(config(d, model="bench"), {})
        s.register_mem_pool_host(kv)
        s.register_mem_host_pool_v2(kv, PoolName.KV)
        s.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        keys = [f"{i:064x}" for i in range(1, PAGES + 1)]
        put = [PoolTransfer(name=n, host_indices=sp.indices(p, range(PAGES)), keys=keys)
               for n, p in ((PoolName.KV, kv), (PoolName.DRAFT, draft))]
        assert all(all(v) for v in s.batch_set_v2(put).values())
        get = [PoolTransfer(name=n, host_indices=sp.indices(p, range(PAGES, 2 * PAGES)), keys=keys)
               for n, p in ((PoolName.KV, kv), (PoolName.DRAFT, draft))]

        def once():
            if not all(all(v) for v in s.batch_get_v2(get).values()):
                raise SystemExit("a page missed: the benchmark measures hits only")

        total = 2 * PAGES * s.page_bytes
        # memcpy the same total bytes into KV's host buffer (2 * PAGES pages: exactly `total`).
        k, m = measure(once, kv.kv_buffer.data_ptr(), total)
        report("batch_get_v2 zero-copy", d, 2 * PAGES, k, m)
        s.close()
    finally:
        d.stop()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
