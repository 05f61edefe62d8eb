"""Measures KvnodeStorage.batch_get_v1 (128 x 1 MiB pages, local hit, zero copy) against memcpy.

Run: `cargo build --release -p kvnode && python clients/python/bench/bench_get_v1.py`
(with the venv from scripts/install-deps.sh). Prints GiB/s for both and the ratio. The host
pool is a memfd from SGLang 0.5.23's own alloc_shm (MFD_CLOEXEC only: unsealable), so the daemon
copies through its SIGBUS-guarded mapping; the line "daemon region mode" shows which copy path
it picked. Calls and memcpys alternate, so both see the same background load. Arguments are
passed to `kvnode serve` (e.g. `--region-copy pread` to measure the descriptor path);
KVNODE_BENCH_SEALABLE=1 makes the pool with MFD_ALLOW_SEALING (the daemon's sealed path).
"""

import ctypes
import fcntl
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from conftest import Daemon  # noqa: E402
from kvnode.wire import Connection  # noqa: E402
from hostpool import ShmMhaPool  # noqa: E402
from kvnode.sglang_backend import KvnodeStorage  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402

PAGES, ITERS = 128, 30


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvnode-bench-"))
    d = Daemon(tmp, dram="1GiB", extra=tuple(sys.argv[1:]))
    try:
        cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, True, True, "bench",
                                   extra_config={"socket": d.socket})
        # page_first, 8 tokens x 32 layers x 8 heads x 128 dim x bf16: K and V 512 KiB each.
        pool = ShmMhaPool("page_first", pages=2 * PAGES, page_size=8, layer_num=32, head_num=8,
                          head_dim=128, sealable=os.environ.get("KVNODE_BENCH_SEALABLE") == "1")
        pool.fill_random(1)
        s = KvnodeStorage(cfg, {})
        s.register_mem_pool_host(pool)
        assert s.zero_copy and s.page_bytes == 1 << 20
        keys = [f"{i:064x}" for i in range(1, PAGES + 1)]
        assert all(s.batch_set_v1(keys, pool.indices(range(PAGES))))
        dst = pool.indices(range(PAGES, 2 * PAGES))
        total = PAGES * s.page_bytes
        src_buf = ctypes.create_string_buffer(total)
        ctypes.memset(src_buf, 7, total)
        dst_addr = pool.kv_buffer.data_ptr()
        kv, mc = [], []
        for i in range(ITERS + 3):  # 3 warm-ups fault the daemon's mapping in
            t = time.perf_counter()
            assert all(s.batch_get_v1(keys, dst))
            t1 = time.perf_counter()
            ctypes.memmove(dst_addr, src_buf, total)
            t2 = time.perf_counter()
            if i >= 3:
                kv.append(total / (t1 - t) / (1 << 30))
                mc.append(total / (t2 - t1) / (1 << 30))
        k, m = statistics.median(kv), statistics.median(mc)
        seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
        regions = Connection(d.socket).stats().get("regions", {})
        mode = [n[len("attached_"):] for n, v in regions.items() if n.startswith("attached_") and v]
        print(f"host pool memfd seals : {seals:#x} (0x1 F_SEAL_SEAL: unsealable; 0x2 F_SEAL_SHRINK)")
        print(f"daemon region mode    : {', '.join(mode) or '?'} {regions}")
        print(f"batch_get_v1 zero-copy: {k:.2f} GiB/s median of {ITERS} ({PAGES} x 1 MiB)")
        print(f"memcpy same size      : {m:.2f} GiB/s median of {ITERS}")
        print(f"ratio                 : {100 * k / m:.0f} %")
        s.close()
    finally:
        d.stop()


if __name__ == "__main__":
    main()
