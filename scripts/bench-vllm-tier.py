#!/usr/bin/env python3
"""Side by side, one run: kvnode's vLLM secondary tier against vLLM 0.33's in-tree tiers.

Every tier runs inside vLLM's real OffloadingConnector / TieringOffloadingManager (scheduler
role, CPU primary tier in /dev/shm), driven the way OffloadingConnectorScheduler drives it:

  store   rows written into the primary tier, complete_store -> cascade jobs -> all finished
  load    a fresh engine (empty primary tier, same backing store) looks every key up, step by
          step, until all are primary hits (async lookup -> promotion -> load job -> hit)
  lookup  16 requests x 16 chunk keys absent from the tier, every request rescanned each step
          (the scheduler's pattern): time inside each manager.lookup call (scheduler thread) and
          steps/wall time until every request is decided
  step    scheduler-thread seconds per step (all manager calls of the step) during the load

Same-run ceiling: one numpy memcpy of the same bytes (host DRAM bandwidth of this machine).

  PY=$(scripts/install-vllm-venv.sh | tail -1)
  KVNODE_BIN=target/release/kvnode $PY scripts/bench-vllm-tier.py --dir /var/tmp/kvt-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python" / "tests_vllm"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402

import conftest  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402

from tier_env import ROW, Engine, keys_and_rows  # noqa: E402


def model_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="kvt-model-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
        "bos_token_id": 1, "eos_token_id": 2}))
    return str(d)


def memcpy_gbs(nbytes: int) -> float:
    a = np.random.randint(0, 255, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class Timed:
    """Wraps an Engine's manager calls to add up scheduler-thread time per step."""

    def __init__(self, e: Engine):
        self.e, self.calls, self.steps = e, [], []

    def lookup_all(self, keys, ctx, limit_s=120.0):
        t0 = time.monotonic()
        while True:
            s0 = time.perf_counter()
            done, hits = True, 0
            with self.e.m.lock:
                for k in keys:
                    c0 = time.perf_counter()
                    r = self.e.m.lookup(k, ctx)
                    self.calls.append(time.perf_counter() - c0)
                    if r.name == "MISS":
                        break
                    hits += 1
                    done &= r.name == "HIT"
                self.e.m.on_schedule_end(conftest_step())
            self.steps.append(time.perf_counter() - s0)
            if done:
                return hits, time.monotonic() - t0
            if time.monotonic() - t0 > limit_s:
                raise RuntimeError("lookups not decided")
            time.sleep(0.001)


def conftest_step():
    from vllm.v1.kv_offload.base import ScheduleEndContext
    return ScheduleEndContext((), ())


def _rows(n, row):
    payload = [os.urandom(row) for _ in range(min(n, 8))]
    return [payload[i % len(payload)] for i in range(n)]


def _load_and_misses(name, e, keys, rows):
    """Times the load of `keys` (absent from the primary tier) and the miss pattern."""
    ctx = ReqContext(req_id="bench-load")
    with e.m.lock:
        e.m.on_new_request(ctx)
    assert not any(e.in_primary(k, ctx) for k in keys[:8]), f"{name}: keys still in the primary tier"
    tm = Timed(e)
    hits, load_s = tm.lookup_all(keys, ctx)
    assert hits == len(keys), f"{name}: {hits} of {len(keys)} loaded"
    assert e.read_loaded(keys[:4], ctx) == rows[:4], f"{name}: loaded bytes differ"
    reqs = [(ReqContext(req_id=f"miss-{i}"), keys_and_rows(16)[0]) for i in range(16)]
    with e.m.lock:
        for c, _ in reqs:
            e.m.on_new_request(c)
    lt = Timed(e)
    t0, open_, steps = time.monotonic(), set(range(16)), 0
    while open_:
        s0 = time.perf_counter()
        with e.m.lock:
            for i in sorted(open_):
                c, ks = reqs[i]
                decided = True
                for k in ks:
                    c0 = time.perf_counter()
                    r = e.m.lookup(k, c)
                    lt.calls.append(time.perf_counter() - c0)
                    if r.name == "MISS":
                        break
                    decided = False
                if decided:
                    open_.discard(i)
            e.m.on_schedule_end(conftest_step())
        lt.steps.append(time.perf_counter() - s0)
        steps += 1
        time.sleep(0.001)
        if time.monotonic() - t0 > 60:
            raise RuntimeError(f"{name}: misses not decided")
    calls = sorted(lt.calls)
    return {"load_gbs": len(keys) * len(rows[0]) / load_s / 1e9, "load_steps": len(tm.steps),
            "sched_ms_per_step_load": 1000 * statistics.mean(tm.steps),
            "lookup_call_us_p50": 1e6 * calls[len(calls) // 2],
            "lookup_call_us_p99": 1e6 * calls[int(len(calls) * 0.99)],
            "miss_decided_ms": 1000 * (time.monotonic() - t0), "miss_steps": steps,
            "sched_ms_per_step_lookup": 1000 * statistics.mean(lt.steps)}


def run_tier(name, tier, socket, md, bpc, total):
    """One engine: store n chunks (timed), store n filler chunks (evicts the first n from the
    primary tier), then load the first n back from the tier (timed) and the miss pattern."""
    row = ROW * bpc
    n = max(1, total // row)
    keys, _, _ = keys_and_rows(n)
    rows = _rows(n, row)
    e = Engine(md, socket, chunks=n, tier=tier, extra={"blocks_per_chunk": bpc})
    try:
        t0 = time.perf_counter()
        e.store(keys, rows, req_id="bench-store")
        store_s = time.perf_counter() - t0
        assert all(r.success for r in e.finished), f"{name}: store jobs failed"
        filler, _, _ = keys_and_rows(n)
        e.store(filler, _rows(n, row), req_id="bench-filler")
        r = _load_and_misses(name, e, keys, rows)
    finally:
        e.close()
    return {"tier": name, "row_bytes": row, "chunks": n, "bytes": n * row,
            "store_gbs": n * row / store_s / 1e9, **r}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="disk directory: fs tier root and kvnode spill dir")
    ap.add_argument("--sizes", default="64,256,1024,2048", help="row KiB (multiples of 4)")
    ap.add_argument("--total-mib", type=int, default=64, help="<= 100 (the daemon has 256 MiB DRAM)")
    ap.add_argument("--tiers", default="kvnode-region,kvnode-arena,kvnode-nvme,fs")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    md = model_dir()
    total = args.total_mib << 20
    conftest.make_request("seed", [3] * 20)  # init_none_hash(sha256), as the engine core does
    out = []
    work = base / f"run-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    spill_gib = max(1, (2 * total) >> 30)
    try:
        print(f"memcpy ceiling ({args.total_mib} MiB): {memcpy_gbs(total):.2f} GB/s", flush=True)
        for kib in [int(x) for x in args.sizes.split(",")]:
            bpc = kib * 1024 // ROW
            ceiling = memcpy_gbs(total)
            for name in args.tiers.split(","):
                if name == "fs":
                    root = work / f"fs-{kib}"
                    tier = {"type": "fs", "root_dir": str(root), "n_read_threads": 4,
                            "n_write_threads": 4}
                    sock = "/nonexistent"  # unused by vLLM's tiers
                elif name == "kvcr":
                    n = max(1, total // (ROW * bpc))
                    tier = {"type": "kvcr", "router_capabilities": ["router_hint"],
                            "control_host": "127.0.0.1", "control_advertise_host": "127.0.0.1",
                            "control_ports": [free_port()], "secondary_g2_slots": 2 * n + 8}
                    sock = "/nonexistent"
                elif name == "kvnode-nvme":
                    tier, sock = {"threads": 4}, None
                else:
                    tier, sock = {"copy": name.split("-")[1], "threads": 4}, None
                if name == "kvnode-nvme":
                    r = run_nvme(work / f"n-{kib}", md, bpc, total, spill_gib)
                elif name.startswith("kvnode-"):  # a fresh daemon: sizes never compete for slabs
                    dd = conftest.Daemon(work / f"d-{name}-{kib}")
                    try:
                        r = run_tier(name, tier, dd.socket, md, bpc, total)
                    finally:
                        dd.stop()
                else:
                    r = run_tier(name, tier, sock, md, bpc, total)
                r["memcpy_gbs"] = ceiling
                out.append(r)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def run_nvme(tmp: Path, md, bpc, total, spill_gib):
    """kvnode with its blocks on the spill tier only: stored, the daemon stopped with SIGTERM
    (it flushes DRAM to the spill file), page cache dropped, restarted cold; a fresh engine
    loads them, so every load reads the disk, like the fs tier's."""
    (tmp / "spill").mkdir(parents=True)
    flags = ("--spill-dir", str(tmp / "spill"), "--spill-size", f"{spill_gib}GiB")
    d = conftest.Daemon(tmp, extra=flags)
    row = ROW * bpc
    n = max(1, total // row)
    keys, _, _ = keys_and_rows(n)
    rows = _rows(n, row)
    extra = {"blocks_per_chunk": bpc}
    a = Engine(md, d.socket, chunks=n + 2, tier={"threads": 4}, extra=extra)
    t0 = time.perf_counter()
    a.store(keys, rows, req_id="bench-store")
    store_s = time.perf_counter() - t0
    a.close()
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(120)
    d.log.close()
    os.system("sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null")
    d = conftest.Daemon(tmp, extra=flags)
    b = Engine(md, d.socket, chunks=n + 2, tier={"threads": 4}, extra=extra)
    try:
        r = _load_and_misses("kvnode-nvme", b, keys, rows)
    finally:
        b.close()
        d.stop()
    return {"tier": "kvnode-nvme", "row_bytes": row, "chunks": n, "bytes": n * row,
            "store_gbs": n * row / store_s / 1e9, **r}


if __name__ == "__main__":
    main()
