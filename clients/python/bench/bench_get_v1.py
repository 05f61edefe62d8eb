"""Measures KvnodeStorage.batch_get_v1 (128 x 1 MiB pages, local hit, zero copy) against memcpy.

Run: `KVNODE_BIN=target/release/kvnode python clients/python/bench/bench_get_v1.py [serve args]`
(with the venv from scripts/install-deps.sh). The host pool is SGLang 0.5.23's own
MHATokenToKVPoolHost allocated through its ShmHostTensorAllocator (`"allocator": "shm"`: an
unsealable memfd), so the daemon copies through its SIGBUS-guarded mapping; the line "daemon
region mode" shows which copy path it picked. Arguments go to `kvnode serve` (e.g.
`--region-copy pread`). Prints GiB/s of the get and of a same-run memcpy of the same bytes into
the same host pages, and the ratio.
"""

from common import GEOMETRY, measure, report, start_daemon

import sglang_pools as sp
from kvnode.sglang.backend import KvnodeStorage
from test_sglang_backend import config

PAGES = 128


def _all(flags):
    if not all(flags):
        raise SystemExit("a page missed: the benchmark measures hits only")


def main(argv) -> None:
    d = start_daemon(argv)
    try:
        pool = sp.mha_pool("page_first", pages=2 * PAGES, **GEOMETRY)
        sp.fill_random(pool, 1)
        s = KvnodeStorage(config(d, model="bench"), {})
        s.register_mem_pool_host(pool)
        assert s.zero_copy and s.page_bytes == 1 << 20
        keys = [f"{i:064x}" for i in range(1, PAGES + 1)]
        assert all(s.batch_set_v1(keys, sp.indices(pool, range(PAGES))))
        dst = sp.indices(pool, range(PAGES, 2 * PAGES))
        total = PAGES * s.page_bytes
        # memcpy the same byte count into the same pool (its first half; the get fills the second)
        k, m = measure(lambda: _all(s.batch_get_v1(keys, dst)), pool.kv_buffer.data_ptr(), total)
        report("batch_get_v1 zero-copy", d, PAGES, k, m)
        s.close()
    finally:
        d.stop()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
