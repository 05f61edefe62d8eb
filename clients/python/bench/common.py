"""Shared set-up of the zero-copy get benchmarks: a daemon, SGLang's own shm host pools, memcpy."""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

from conftest import Daemon  # noqa: E402
from kvnode.wire import Connection  # noqa: E402

# page_first, 8 tokens x 32 layers x 8 heads x 128 dim x bf16: K and V 512 KiB each, 1 MiB a page.
GEOMETRY = dict(page_size=8, layer_num=32, head_num=8, head_dim=128)
ITERS, WARMUP = 30, 3


def start_daemon(extra) -> Daemon:
    return Daemon(Path(tempfile.mkdtemp(prefix="kvnode-bench-")), dram="1GiB", extra=tuple(extra))


def measure(get, dst_addr: int, total: int):
    """Alternates one `get()` and one memcpy of the same bytes into the same host pages, so both
    see the same background load; returns (get GiB/s, memcpy GiB/s) medians."""
    src = ctypes.create_string_buffer(total)
    ctypes.memset(src, 7, total)
    kv, mc = [], []
    for i in range(ITERS + WARMUP):  # the warm-ups fault the daemon's mapping in
        t = time.perf_counter()
        get()
        t1 = time.perf_counter()
        ctypes.memmove(dst_addr, src, total)
        t2 = time.perf_counter()
        if i >= WARMUP:
            kv.append(total / (t1 - t) / (1 << 30))
            mc.append(total / (t2 - t1) / (1 << 30))
    return statistics.median(kv), statistics.median(mc)


def report(label: str, daemon: Daemon, pages: int, k: float, m: float) -> None:
    regions = Connection(daemon.socket).stats().get("regions", {})
    mode = [n[len("attached_"):] for n, v in regions.items() if n.startswith("attached_") and v]
    print(f"daemon region mode    : {', '.join(mode) or '?'} {regions}")
    print(f"{label:22}: {k:.2f} GiB/s median of {ITERS} ({pages} x 1 MiB)")
    print(f"memcpy same size      : {m:.2f} GiB/s median of {ITERS}")
    print(f"ratio                 : {100 * k / m:.0f} %")
