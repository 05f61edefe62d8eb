"""Decode step time of the engine-like step (harness/decode.py) against the eager one, on CUDA.

Per batch size and context length: the CUDA-graph replay alone (device events) and the whole
`GraphDecoder.step` as the open loop calls it (host inputs, replay, tokens back on the host),
with the bytes a step must read (weights once + every sequence's KV) over that time. Also the
eager per-sequence decode (`batched.forward`, the harness's decode before issue 44) at a few
points, and the correctness of the step: the Triton split-K attention and the graph replay
against the SDPA reference run eagerly, on the same pool.

Usage (from bench/ttft):  python -m harness.decode_bench --out DIR [--model qwen3-8b] [--fused]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List

import torch

from . import batched
from .decode import DecodeSeq, GraphDecoder
from .model import CONFIGS, Decoder
from .pool import KvPool


def _seqs(batch: int, ctx: int, per: int, g: torch.Generator) -> List[DecodeSeq]:
    # Each sequence its own scattered pages (a shuffled block table, as a busy pool has).
    out = []
    for i in range(batch):
        pages = (torch.randperm(per, generator=g) + i * per).tolist()
        out.append(DecodeSeq(int(torch.randint(0, 1000, (1,), generator=g)), ctx, pages))
    return out


def _replay_ms(dec: GraphDecoder, seqs: List[DecodeSeq], reps: int) -> float:
    dec.step(seqs)
    bk = dec.bucket_for(len(seqs))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        bk.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _step_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def correctness(model: Decoder, pool: KvPool, per: int, g: torch.Generator) -> Dict:
    seqs = _seqs(4, 4000, per, g)
    ref = GraphDecoder(model, pool, per, 4, attn="sdpa", graphs=False)
    ref.step(seqs)
    want = ref.bucket_for(4).logits.float().clone()
    out = {}
    for name, kw in (("triton_eager", {"attn": "triton", "graphs": False}),
                     ("triton_graph", {"attn": "triton", "graphs": True}),
                     ("sdpa_graph", {"attn": "sdpa", "graphs": True}),
                     ("triton_graph_fused", {"attn": "triton", "graphs": True, "fused": True})):
        d = GraphDecoder(model, pool, per, 4, **kw)
        d.step(seqs)
        got = d.bucket_for(4).logits.float()
        out[name] = {"rel_l2_vs_sdpa_eager": ((got - want).norm() / want.norm()).item(),
                     "max_abs": (got - want).abs().max().item(),
                     "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}
    # The harness's old decode path over the same pages.
    old = batched.forward(model, [batched.Seq(torch.tensor([s.last]), s.ctx, torch.tensor(s.pages)) for s in seqs], pool)
    out["eager_batched_forward"] = {"rel_l2_vs_sdpa_eager": ((old - want).norm() / want.norm()).item(),
                                    "argmax_equal": bool(torch.equal(old.argmax(-1), want.argmax(-1)))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fused", action="store_true", help="also time the step with harness/fused.py's kernels")
    a = ap.parse_args(argv)
    cfg = CONFIGS[a.model]
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [int(x) for x in a.contexts.split(",")]
    per = max(ctxs) // cfg.page_size + 2
    model = Decoder(cfg, "cuda:0")
    pool = KvPool(cfg, max(batches) * per, "cuda:0")
    pool.t.normal_()  # never time on zeros
    g = torch.Generator().manual_seed(44)
    res: Dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "model": cfg.name,
                 "weight_bytes": cfg.params * 2, "kv_bytes_per_token": cfg.kv_bytes_per_token, "points": []}
    res["correctness"] = correctness(model, pool, per, g)
    print(json.dumps(res["correctness"], indent=1), flush=True)
    t = time.perf_counter()
    dec = GraphDecoder(model, pool, per, max(batches))
    res["capture_s"] = time.perf_counter() - t
    res["attn"] = dec.attn
    fused = GraphDecoder(model, pool, per, max(batches), fused=True) if a.fused else None
    for ctx in ctxs:
        for b in batches:
            seqs = _seqs(b, ctx, per, g)
            replay = _replay_ms(dec, seqs, a.reps)
            step = _step_ms(lambda: dec.step(seqs), a.reps)
            kv = b * (ctx + 1) * cfg.kv_bytes_per_token
            p = {"batch": b, "ctx": ctx, "replay_ms": replay, "step_ms": step,
                 "bytes": res["weight_bytes"] + kv, "GBps_replay": (res["weight_bytes"] + kv) / replay / 1e6}
            if fused is not None:
                p["fused_replay_ms"] = _replay_ms(fused, seqs, a.reps)
                p["fused_step_ms"] = _step_ms(lambda: fused.step(seqs), a.reps)
            if (b, ctx) in ((1, 4096), (4, 4096), (8, 4096)):
                bs = [batched.Seq(torch.tensor([s.last]), s.ctx, torch.tensor(s.pages)) for s in seqs]
                p["eager_ms"] = _step_ms(lambda: batched.forward(model, bs, pool).argmax(-1).tolist(), 5)
            res["points"].append(p)
            print(f"ctx {ctx:5d} batch {b:2d}: replay {replay:6.2f} ms, step {step:6.2f} ms, "
                  f"{p['GBps_replay']:6.0f} GB/s" + (f", eager {p['eager_ms']:.1f} ms" if "eager_ms" in p else "")
                  + (f", fused replay {p['fused_replay_ms']:.2f} ms" if "fused_replay_ms" in p else ""),
                  flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "decode-bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
