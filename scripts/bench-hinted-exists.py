#!/usr/bin/env python3
"""Per-op latency of hinted `Exists` over many ops: it must stay flat as the op table grows
(every hinted op is registered; long-ended ones are swept). Starts its own daemon.

Usage: scripts/bench-hinted-exists.py KVNODE_BIN [OPS] [BATCH]   (default 40000 ops, 5000 a row)
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "clients", "python"))
from kvnode.wire import Connection, key  # noqa: E402


def main():
    binary = sys.argv[1]
    ops = int(sys.argv[2]) if len(sys.argv) > 2 else 40000
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
    tmp = tempfile.mkdtemp(prefix="kvnode-hinted-")
    sock = os.path.join(tmp, "kvnode.sock")
    d = subprocess.Popen([binary, "serve", "--socket", sock, "--dram", "64MiB", "--no-pin",
                          "--peers", "tcp://127.0.0.1:9"], stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            try:
                c = Connection(sock)
                break
            except OSError:
                time.sleep(0.01)
        ns = c.register({"model": "hinted", "page_size": 64, "segments": [4096]})["ns"]
        keys = [key(bytes([i]) * 32) for i in range(2)]
        hashes = [int.from_bytes(bytes([i]) * 8, "big") for i in range(2)]
        # An authorized, unreachable endpoint: the op is registered and its pull fails fast.
        hint = '{"source_control_endpoint":"tcp://127.0.0.1:9","block_hashes":%s}' % hashes
        print(f"{binary}: {ops} hinted Exists, p50/p99 per {batch}")
        for start in range(0, ops, batch):
            lat = []
            for _ in range(batch):
                t = time.perf_counter()
                c.call({"Exists": {"ns": ns, "keys": keys, "hint": hint}})
                lat.append(time.perf_counter() - t)
            lat.sort()
            print(f"  ops {start:>6}-{start + batch:<6} p50 {statistics.median(lat) * 1e3:.3f} ms"
                  f"  p99 {lat[int(len(lat) * 0.99)] * 1e3:.3f} ms")
    finally:
        d.kill()
        d.wait()


if __name__ == "__main__":
    main()
