"""The connector's worker side on a real GPU, without vllm (torch + a real daemon).

Run on a CUDA machine:  python clients/python/tests_vllm/gpu_worker.py KVNODE_BIN [OUTDIR]

KV tensors are laid out exactly as vLLM 0.33's allocate_kv_cache does (one int8 backing
allocation, per-layer [B, N, H, K|V] views at offset + l*layer_stride + b*block_stride), in the
layer-outermost layout (LBNHC, vLLM's default) and the block-outermost one (BLNHC). Checks:
  1. save -> zero -> load into permuted block ids: every byte equal, no other block written;
  2. a load of blocks kvnode never stored is reported by take_load_errors (vLLM recomputes);
  3. a cancelled load: Loaded blocks byte-equal, Cancelled ones untouched and reported;
  4. finished(): requests are reported only after their offloads ended.
Bench (env BENCH="LAYOUT:TOKENS,..."; default LBNHC:16,BLNHC:16): onload of BENCH_GIB (3) GiB of
vLLM blocks of a Llama-3-8B shape (32 layers, 8 KV heads, head 128, fp16: 64 KiB pages at 16
tokens) vs a same-run pinned cudaMemcpy H2D of the same bytes; offload vs pinned D2H. JSON out.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvnode.gpu import GpuClient  # noqa: E402
from kvnode.vllm.keys import RankGeometry, Segment  # noqa: E402
from kvnode.vllm.plan import BlockMove  # noqa: E402
from kvnode.vllm.worker_side import Placement, WorkerSide  # noqa: E402
from kvnode.wire import Connection  # noqa: E402

BIN = sys.argv[1]
OUT = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
RESULTS = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def log(*a):
    print(*a, flush=True)


class Daemon:
    def __init__(self, dram: str, tag: str):
        d = Path(tempfile.mkdtemp(prefix=f"kvnode-{tag}-"))
        self.sock = str(d / "kvnode.sock")
        self.logf = open(OUT / f"daemon-{tag}.log", "w")
        self.p = subprocess.Popen([BIN, "serve", "--socket", self.sock, "--dram", dram],
                                  stdout=subprocess.DEVNULL, stderr=self.logf)
        for _ in range(200):
            if os.path.exists(self.sock):
                try:
                    Connection(self.sock).close()
                    break
                except OSError:
                    pass
            time.sleep(0.05)
        c = Connection(self.sock)
        t0 = time.time()
        self.gpu_stats = GpuClient(c).wait_registered(180)
        log(f"daemon {tag}: arena registered in {time.time() - t0:.1f}s: {self.gpu_stats}")
        c.close()

    def connect(self):
        return Connection(self.sock, client="gpu-worker-check", timeout=120)

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=30)
        self.logf.close()


class VllmKv:
    """vLLM 0.33's KV allocation: one backing buffer, a layer view per layer (fp16)."""

    def __init__(self, layout: str, layers: int, blocks: int, tokens: int, heads: int, head: int):
        self.layers, self.blocks = layers, blocks
        self.c = 2 * head                        # K and V content of one (token, head) cell
        self.page = tokens * heads * self.c * 2  # bytes per (layer, block)
        if layout == "LBNHC":
            self.layer_stride, self.block_stride = self.page * blocks, self.page
        elif layout == "BLNHC":
            self.layer_stride, self.block_stride = self.page, self.page * layers
        else:
            raise ValueError(layout)
        self.layout = layout
        self.buf = torch.zeros(self.page * blocks * layers, dtype=torch.int8, device="cuda")
        half = self.buf.view(torch.float16)
        self.views = [torch.as_strided(half, (blocks, tokens, heads, self.c),
                                       (self.block_stride // 2, heads * self.c, self.c, 1),
                                       l * self.layer_stride // 2) for l in range(layers)]

    def placement(self) -> Placement:
        return Placement(0, self.layer_stride, self.block_stride, self.layers, self.page, self.blocks)

    def geometry(self, tag: str) -> RankGeometry:
        return RankGeometry(model=f"gpu-check-{tag}", dtype="auto:float16", block_size=16,
                            layout=self.layout, hash_algo="sha256", num_kv_heads=8, head_size=128,
                            num_layers=self.layers, segments=(Segment(self.layers, self.page),))

    def block(self, b: int, src=None) -> torch.Tensor:
        """Block b's bytes in kvnode order (layer 0 page, layer 1 page, ...)."""
        src = self.buf if src is None else src
        return torch.cat([src[l * self.layer_stride + b * self.block_stride:][:self.page]
                          for l in range(self.layers)])

    def randomize(self):
        self.buf.copy_(torch.randint(-128, 128, self.buf.shape, dtype=torch.int8, device="cuda"))
        torch.cuda.synchronize()


def digests(tag: str, n: int):
    import hashlib
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def check_correctness(d: Daemon, layout: str):
    kv = VllmKv(layout, layers=4, blocks=256, tokens=16, heads=8, head=128)
    spec = kv.geometry("ok").namespace_spec()
    ws = WorkerSide(d.connect, spec)
    ws.register(kv.views[0], [kv.placement()])
    kv.randomize()
    ref = kv.buf.clone()
    d1, d2 = digests(layout + "r1", 128), digests(layout + "r2", 64)
    # The offloads wait for a CUDA event recorded after ~1 s of GPU work on the current stream:
    # finished() must not report r1/r2 before their offloads ended.
    torch.cuda._sleep(int(2e9))
    ws.save([BlockMove("r1", d1, list(range(128))), BlockMove("r2", d2, list(range(128, 192)))])
    early = ws.finished({"r1", "r2"})
    assert early == set(), f"reported {early} before their offloads ended"
    assert ws.drain(timeout_s=60)
    done = ws.finished(set())
    assert done == {"r1", "r2"}, done
    assert ws.finished({"r1"}) == set(), "a request is reported once"
    assert ws.stats["save_stored"] == 192, ws.stats
    kv.buf.zero_()
    torch.cuda.synchronize()
    # 1. Load r1 into permuted block ids.
    targets = [255 - i for i in range(128)]
    fails = ws.load([BlockMove("r1", d1, targets)])
    assert fails == 0 and ws.take_load_errors() == set()
    torch.cuda.synchronize()
    for i, t in enumerate(targets):
        assert torch.equal(kv.block(t), kv.block(i, ref)), f"{layout}: block {i} -> {t} differs"
    for b in range(0, 128):
        assert not kv.block(b).any(), f"{layout}: block {b} was written but not loaded"
    # 2. Blocks kvnode never stored: every one reported, none written.
    missing = digests(layout + "never", 8)
    fails = ws.load([BlockMove("r3", missing, list(range(8)))])
    errs = ws.take_load_errors()
    assert fails == 8 and errs == set(range(8)), (fails, errs)
    assert not any(kv.block(b).any() for b in range(8))
    ws.close()
    return {"layout": layout, "blocks_saved": 192, "bytes_equal_blocks": 128, "missing_reported": 8,
            "finished_before_offloads_ended": sorted(early), "finished_after": sorted(done)}


def bench(d: Daemon, layout: str, tokens: int, total_bytes: int, reps: int = 3):
    blocks = total_bytes // (32 * tokens * 8 * 256 * 2)
    kv = VllmKv(layout, layers=32, blocks=blocks, tokens=tokens, heads=8, head=128)
    spec = kv.geometry("bench").namespace_spec()
    ws = WorkerSide(d.connect, spec)
    ws.register(kv.views[0], [kv.placement()])
    kv.randomize()
    ref = kv.buf.clone()
    n = blocks
    dg = digests(layout + "bench", n)
    nbytes = n * kv.layers * kv.page
    t0 = time.perf_counter()
    ws.save([BlockMove("b", dg, list(range(n)))])
    assert ws.drain(timeout_s=300)
    save_s = time.perf_counter() - t0
    assert ws.stats["save_stored"] == n, ws.stats
    loads = []
    for _ in range(reps):
        kv.buf.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fails = ws.load([BlockMove("b", dg, list(range(n)))])
        loads.append(time.perf_counter() - t0)
        assert fails == 0
    torch.cuda.synchronize()
    assert torch.equal(kv.buf, ref), f"{layout}: bench onload bytes differ"
    # Cancel: start a full load, cancel at once; Loaded blocks equal, Cancelled ones untouched.
    kv.buf.zero_()
    torch.cuda.synchronize()
    tickets = ws.start_load([BlockMove("b", dg, list(range(n)))])
    failed = ws.finish_load(tickets, cancel=True)
    errs = ws.take_load_errors()
    torch.cuda.synchronize()
    assert failed == len(errs)
    for b in range(n):
        if b in errs:
            assert not kv.block(b).any(), f"cancelled block {b} was written"
        else:
            assert torch.equal(kv.block(b), kv.block(b, ref)), f"loaded block {b} differs"
    ws.close()
    # Same-run physical limits: one pinned cudaMemcpy of the same bytes each way.
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    dev = kv.buf[:nbytes]
    h2d, d2h = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
    gb = nbytes / 1e9
    r = {"layout": layout, "block_tokens": tokens, "page_bytes": kv.page, "blocks": n, "block_bytes": kv.layers * kv.page, "objects_per_block":
         len(kv.placement().layout(0).objects), "bytes": nbytes,
         "onload_GBps": round(gb / min(loads), 2), "onload_GBps_all": [round(gb / t, 2) for t in loads],
         "pinned_h2d_GBps": round(gb / min(h2d), 2), "offload_GBps": round(gb / save_s, 2),
         "pinned_d2h_GBps": round(gb / min(d2h), 2), "cancel_cancelled_blocks": len(errs)}
    r["onload_vs_pinned"] = round(r["onload_GBps"] / r["pinned_h2d_GBps"], 3)
    r["offload_vs_pinned"] = round(r["offload_GBps"] / r["pinned_d2h_GBps"], 3)
    del host
    return r


def main():
    if os.environ.get("CHECKS", "1") == "1":
        ok = Daemon("2GiB", "ok")
        try:
            RESULTS["correctness"] = [check_correctness(ok, lay) for lay in ("LBNHC", "BLNHC")]
            log("correctness:", RESULTS["correctness"])
        finally:
            ok.stop()
    total = int(float(os.environ.get("BENCH_GIB", "3")) * (1 << 30))
    RESULTS["bench"] = []
    # One daemon per configuration: the DRAM tier keeps slabs in the slot class that took them.
    for cfg in os.environ.get("BENCH", "LBNHC:16,BLNHC:16").split(","):
        lay, tokens = cfg.split(":")
        d = Daemon(os.environ.get("BENCH_DRAM", "8GiB"), f"bench-{lay}-{tokens}")
        try:
            RESULTS["bench"].append(bench(d, lay, int(tokens), total))
            log("bench:", RESULTS["bench"][-1])
        finally:
            d.stop()
    (OUT / "gpu_worker.json").write_text(json.dumps(RESULTS, indent=1))
    log(json.dumps(RESULTS, indent=1))
    log("GPU WORKER CHECK PASSED")


if __name__ == "__main__":
    main()
