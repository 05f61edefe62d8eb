"""A worker process: builds the model once and runs the sections its spec names.

Sections: `memcpy` (same-run pinned copy bandwidth), `correctness` (onloaded KV gives the same
first-token logits as KV computed in place), `long_prefix` (one long prefix from each tier
against recompute, with the time split), `workload` (arms interleaved request by request).
Each section's result (or its error) goes into the JSON written at `out`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import statistics
import time
import traceback
from typing import Dict, List, Optional

import torch

from . import sweep
from .lane import Lane, sync
from .model import CONFIGS, Decoder, prefill_flops
from .pool import KvPool
from .throttle import DiskThrottle, ThrottleError
from .tier import DaemonTier, Router, TierSpec
from .workload import Request, WorkloadConfig, generate


def _tokens(seed: str, n: int, vocab: int) -> List[int]:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:7], "big"))
    return torch.randint(0, vocab, (n,), generator=g).tolist()


class Worker:
    def __init__(self, spec: Dict, barrier=None):
        self.spec = spec
        self.cfg = CONFIGS[spec["model"]]
        self.device = spec["device"]
        self.barrier = barrier
        t = time.perf_counter()
        self.model = Decoder(self.cfg, self.device, seed=spec.get("seed", 0))
        sync(self.model.device)
        self.init_s = time.perf_counter() - t
        self.router = Router()
        # Lanes opened and not yet closed (id -> name): a section must leave none (tests).
        self.open_lanes: Dict[int, str] = {}
        self.lanes_opened = 0

    # -- helpers -----------------------------------------------------------------------------
    def lane(self, name: str, pages: int, tier: Optional[Dict] = None, layout: Optional[str] = None) -> Lane:
        pool = KvPool(self.cfg, pages, self.device, layout or self.spec.get("layout", "layer_first"))
        t = None
        if tier:
            ts = TierSpec(**{"mover": self.spec.get("mover", "dma"), **tier})
            try:
                t = DaemonTier(ts, pool, self.router if ts.kind == "peer" else None, client=f"ttft-{name}")
            except BaseException:
                self._free([pool])
                raise
        ln = Lane(name, self.model, pool, t)
        self.lanes_opened += 1
        self.open_lanes[id(ln)] = name
        return ln

    def close(self, *lanes: Lane) -> None:
        """Ends lanes: waits for their offloads, closes their daemon connections (the daemon
        lets go of the pool's IPC mapping), then frees their pools' GPU memory (KvPool.release;
        without it an exported pool stays allocated for the rest of the run). Every lane a
        section opens is closed here, also when its arm failed (issue 41's OOM)."""
        errors = []
        for ln in lanes:
            if self.open_lanes.pop(id(ln), None) is None:
                continue  # closed already
            try:
                if ln.tier is not None:
                    try:
                        ln.finish()
                    finally:
                        ln.tier.close()
            except Exception as e:  # noqa: BLE001 - the pool is freed all the same
                errors.append(e)
        self._free([ln.pool for ln in lanes])
        if errors:
            raise errors[0]

    def _free(self, pools: List[KvPool]) -> None:
        for pool in pools:
            pool.release()
        gc.collect()  # lanes in reference cycles (threads, callbacks) go now, not at some later gc
        if self.model.device.type == "cuda":
            torch.cuda.ipc_collect()  # exports whose counters were dropped leave torch's IPC limbo
            torch.cuda.empty_cache()

    def req(self, idx: int, tokens: List[int]) -> Request:
        return Request(idx, -1, 0, None, tokens)

    # -- sections ----------------------------------------------------------------------------
    def memcpy(self) -> Dict:
        """Pinned host <-> device copy bandwidth (torch -> cudaMemcpyAsync), same run."""
        if self.model.device.type != "cuda":
            return {"skipped": "no CUDA device"}
        n = int(self.spec.get("memcpy_bytes", 4 << 30))
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        out = {"bytes": n}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)
            sync(self.model.device)
            best = []
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                best.append(n / (a.elapsed_time(b) / 1e3) / 1e9)
            out[f"{name}_GBps"] = max(best)
        del host, dev
        return out

    def correctness(self) -> Dict:
        """Onloaded KV versus KV computed in place: bitwise first-token logits and page bytes."""
        c = self.spec["correctness"]
        ps, v = self.cfg.page_size, self.cfg.vocab
        pre = _tokens("corr/prefix", c["prefix_pages"] * ps, v)
        s1, s2 = _tokens("corr/s1", c["suffix"], v), _tokens("corr/s2", c["suffix"], v)
        pages = c["prefix_pages"] + 8
        out = {}
        ref = self.lane("corr-gpu", pages)
        ref.serve(self.req(0, pre + s1))
        r_gpu = ref.serve(self.req(1, pre + s2), keep_logits=True)
        full = self.lane("corr-full", pages)
        r_full = full.serve(self.req(1, pre + s2), keep_logits=True)
        for path, tier_x, tier_y in c["paths"]:
            x = self.lane(f"corr-{path}-x", pages, tier_x)
            y = self.lane(f"corr-{path}-y", pages, tier_y)
            x.serve(self.req(0, pre + s1))
            x.finish()
            r_y = y.serve(self.req(1, pre + s2), keep_logits=True)
            kv_equal = all(
                torch.equal(x.pool.page(x.cache.table[d]).view(torch.uint8),
                            y.pool.page(y.cache.table[d]).view(torch.uint8))
                for d in y.digests(self.req(1, pre + s2))[: r_y["tier_hit_tokens"] // ps])
            diff = (r_y["logits"] - r_full["logits"]).abs().max().item()
            out[path] = {
                "tier_hit_tokens": r_y["tier_hit_tokens"], "prompt_tokens": r_y["prompt_tokens"],
                "kv_pages_bitwise_equal": kv_equal,
                "logits_bitwise_equal_to_gpu_cached": bool(torch.equal(r_y["logits"], r_gpu["logits"])),
                "max_abs_diff_vs_full_recompute": diff,
                "first_token_equal_full_recompute": r_y["first_token"] == r_full["first_token"],
                "logit_scale": r_full["logits"].abs().max().item(),
            }
            self.close(x, y)
        self.close(ref, full)
        return out

    def long_prefix(self) -> Dict:
        """One long prefix: recompute vs each tier, with the TTFT split into fetch and compute."""
        c = self.spec["long_prefix"]
        ps, v = self.cfg.page_size, self.cfg.vocab
        L, S, reps = c["tokens"], c["suffix"], c.get("reps", 3)
        pages = -(-(L + S) // ps) + 2
        out: Dict = {"tokens": L, "suffix": S, "page_bytes": self.cfg.page_bytes,
                     "prefix_bytes": (L // ps) * self.cfg.page_bytes,
                     "prefill_tflop": prefill_flops(self.cfg, 0, L + S) / 1e12}
        prompt = _tokens("long/0", L, v) + _tokens("long/s", S, v)
        # Recompute (warm the kernels first with a shorter prompt).
        rc = self.lane("long-recompute", pages)
        try:
            rc.serve(self.req(99, _tokens("long/warm", min(L, 4096) + S, v)))
            runs = []
            for _ in range(reps):
                rc.cache.clear()
                runs.append(rc.serve(self.req(0, prompt)))
            out["recompute"] = _summ(runs)
            out["recompute"]["tflops"] = prefill_flops(self.cfg, 0, L + S) / 1e12 / out["recompute"]["ttft_s"]
            # The suffix alone after a cached prefix (what remains once the prefix is fetched).
            runs = []
            for _ in range(reps):
                rc.cache.clear()
                rc.serve(self.req(0, prompt))
                runs.append(rc.serve(self.req(0, prompt)))
            out["gpu_cached"] = _summ(runs)
            if any(p.get("plan") for p in c["paths"]):
                # The engine's recompute cost for the plan paths: given, or fitted here (issue 41).
                out["plan_cost"] = c.get("plan_cost") or self._fit_cost(rc, out["recompute"], prompt, c)
        finally:
            self.close(rc)
        del rc
        cuda = self.model.device.type == "cuda"
        for skipped, why in (c.get("skipped") or {}).items():
            out[f"{skipped}_skipped"] = why  # a string: not a row
        for path in c["paths"]:
            name, layout = path["name"], path.get("layout")
            if path.get("plan"):
                path = dict(path, tier=dict(path["tier"], plan=out["plan_cost"]))
            try:
                if path.get("disk_throttle"):
                    # The slow-disk arms: the NVMe daemon's reads from its disk limited for
                    # this arm only (harness/throttle.py); never run unthrottled.
                    dt = path["disk_throttle"]
                    try:
                        th = DiskThrottle(dt["pid"], dt["path"], dt["read_bps"]).up()
                    except ThrottleError as e:
                        out[f"{name}_skipped"] = f"no disk throttle: {e}"
                        continue
                    try:
                        out[name] = self._long_path(path, prompt, pages, path.get("reps", reps), layout)
                        out[name]["disk_throttle"] = th.describe()
                    finally:
                        th.down()
                else:
                    out[name] = self._long_path(path, prompt, pages, path.get("reps", reps), layout)
            except Exception as e:  # noqa: BLE001 - one path failing must not hide the others
                out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            if cuda:  # what the arm left on the GPU (its lanes closed): the model, nothing else
                torch.cuda.empty_cache()
                out[name]["gpu_allocated_after_bytes"] = torch.cuda.memory_allocated()
        out["lanes_open_after"] = sorted(self.open_lanes.values())
        return out

    def _fit_cost(self, rc: Lane, recompute: Dict, prompt: List[int], c: Dict) -> Dict:
        """The engine's recompute cost for fetch plans (issue 41, docs/ttft.md "Measuring the
        recompute cost"), in the daemon's model: computing tokens `[c, x)` with `[0, c)` cached
        takes `T(c, x) = n / tokens_per_s + quad_s * n² + ctx_s * n * c`, `n = x − c`.

        `tokens_per_s` and `quad_s` go through two full prefills (nothing cached): a short
        prompt timed here (best of 3) and the long prompt's recompute (`recompute`, median).
        `ctx_s`, the tail's attention to the cached context, comes from a tail: the long
        prompt with its leading `mixed_dram_frac` (whole pages, as the mixed arm's DRAM part)
        in the lane's GPU prefix cache, `t_tail = T(head, long)` (best of 3). The fixed cost
        per prefill lands in the linear term; see fit_recompute_cost for the fallbacks. `fit`
        holds every measurement beside what the fitted model predicts for it."""
        ps, n_long = self.cfg.page_size, len(prompt)
        n_short = int(c.get("plan_fit_tokens", min(8192, max(ps, n_long // 4))))
        short = _tokens("long/fit", n_short, self.cfg.vocab)
        ts = []
        for _ in range(3):
            rc.cache.clear()
            ts.append(rc.serve(self.req(98, short))["ttft_s"])
        # The tail: the head computed into the GPU prefix cache first, then the whole prompt
        # served: only the tokens after the head are computed, over the cached head.
        frac = float(c.get("mixed_dram_frac", 0.5))
        head_pages = max(1, int(((n_long - 1) // ps) * frac))
        tails = []
        for _ in range(3):
            rc.cache.clear()
            rc.serve(self.req(97, prompt[:head_pages * ps]))
            tails.append(rc.serve(self.req(0, prompt)))
        rc.cache.clear()
        tail = min(tails, key=lambda r: r["ttft_s"])
        x_head = int(tail["gpu_hit_tokens"])  # what the cache held (head_pages * ps)
        t_short, t_long = min(ts), recompute["ttft_s"]
        f = fit_recompute_cost(n_short, t_short, n_long, t_long, x_head, tail["ttft_s"])
        T = f.pop("T")
        return {"tokens_per_s": f["tokens_per_s"], "quad_s": f["quad_s"], "ctx_s": f["ctx_s"], "fit": {
            "short_tokens": n_short, "short_s": t_short, "short_predicted_s": T(0, n_short),
            "long_tokens": n_long, "long_s": t_long, "long_predicted_s": T(0, n_long),
            "tail_head_tokens": x_head, "tail_tokens": tail["computed_tokens"], "tail_s": tail["ttft_s"],
            "tail_runs_s": sorted(r["ttft_s"] for r in tails), "tail_predicted_s": T(x_head, n_long),
            "fallback_linear": f["fallback_linear"], "ctx_fallback": f["ctx_fallback"]}}

    def _long_path(self, path: Dict, prompt: List[int], pages: int, reps: int, layout) -> Dict:
        v = self.cfg.vocab
        L = len(prompt)
        if path["kind"] == "peer":
            src = self.lane(f"long-{path['name']}-src", pages, path["source"], layout)
            try:
                dst = self.lane(f"long-{path['name']}-dst", pages, path["tier"], layout)
            except BaseException:
                self.close(src)
                raise
            try:
                runs = []
                for r in range(reps):
                    p = prompt if r == 0 else _tokens(f"long/peer/{r}", L, v)
                    src.serve(self.req(10 + r, p))
                    src.finish()
                    dst.finish()
                    dst.cache.clear()
                    runs.append(dst.serve(self.req(10 + r, p)))
            finally:
                self.close(src, dst)
            out = _summ(runs)
            if any("plan" in r for r in runs):
                out["plans"] = [r.get("plan") for r in runs]
            return out
        ln = self.lane(f"long-{path['name']}", pages, path["tier"], layout)
        try:
            return self._long_local(ln, path, prompt, reps)
        finally:
            self.close(ln)

    def _long_local(self, ln: Lane, path: Dict, prompt: List[int], reps: int) -> Dict:
        """One arm of a local tier (dram, nvme, mixed) on its lane `ln` (closed by the caller)."""
        v = self.cfg.vocab
        L = len(prompt)
        ln.serve(self.req(0, prompt))  # computes and offloads the prefix
        ln.finish()
        promo0 = ln.tier.promotions()
        runs = []
        for rep in range(reps):
            # Before every rep, prompts of the prefix's length that share nothing with it push
            # it out of DRAM onto NVMe again (the rep before promoted it back), so every rep,
            # not only the first, reads the prefix from the spill dir.
            for i in range(path.get("filler_prompts", 0)):
                ln.finish()
                ln.cache.clear()
                ln.serve(self.req(50 + i, _tokens(f"long/fill/{rep}/{i}", L, v)))
                ln.finish()
            ln.finish()
            ln.cache.clear()
            if path.get("dram_frac"):
                # Mixed prefix: its leading part back in DRAM (promoted, outside the TTFT), the
                # rest on NVMe only.
                digs = ln.digests(self.req(0, prompt))[:(L - 1) // self.cfg.page_size]
                k = int(len(digs) * float(path["dram_frac"]))
                t = ln.tier
                t.conn.get_lease_each(t.ns, t.keys(digs[:k]), lambda _at, _ext: None)
            p0 = ln.tier.promotions()
            r = ln.serve(self.req(0, prompt))
            r["promoted_pages"] = ln.tier.promotions() - p0
            runs.append(r)
        out = _summ(runs)
        out["promoted_pages_per_rep"] = [r["promoted_pages"] for r in runs]
        if any("plan" in r for r in runs):
            out["plans"] = [r.get("plan") for r in runs]
        out["promoted_pages"] = sum(out["promoted_pages_per_rep"])
        out["promotions_before"] = promo0
        out["tier_stats"] = {t["tier"]: {k: t.get(k) for k in ("blocks", "demotions", "promotions", "dropped", "evictions", "poisoned")}
                             for t in ln.tier.conn.stats()["tiers"]}
        return out

    def warm_up(self) -> None:
        """Runs the kernels once outside any measurement (both attention paths)."""
        warm = self.lane("warm-ol", 4096 // self.cfg.page_size + 2)
        wt = _tokens("warm", 2048, self.cfg.vocab)
        warm.serve(self.req(-1, wt))
        warm.serve(self.req(-2, wt + _tokens("warm2", 1000, self.cfg.vocab)))
        self.close(warm)

    def openloop(self) -> Dict:
        """Open-loop rate sweep per arm (harness/sweep.py, harness/openloop.py)."""
        return sweep.run(self)

    def workload(self) -> Dict:
        """Arms interleaved request by request (rotating which arm goes first)."""
        w = self.spec["workload"]
        wcfg = WorkloadConfig(**w["config"])
        workers, widx = self.spec.get("workers", 1), self.spec.get("worker_index", 0)
        reqs = generate(wcfg)
        per = len(reqs) // workers
        mine = [r for r in reqs if r.idx % workers == widx][:per]
        arms = []
        for a in w["arms"]:
            lanes = [self.lane(ln["name"], w["pool_pages"], ln.get("tier"), ln.get("layout")) for ln in a["lanes"]]
            arms.append((a["arm"], lanes))
        names = [a for a, _ in arms]
        results: Dict[str, List[Dict]] = {a: [] for a in names}
        agree: Dict[str, List[float]] = {a: [] for a in names}
        # Warm the kernels outside the measurement (random tokens that no request shares).
        # Both attention paths: from scratch, and after a cached prefix (lower-right causal).
        warm = self.lane("warm", 4096 // self.cfg.page_size + 2)
        wt = _tokens("warm", 2048, self.cfg.vocab)
        warm.serve(self.req(-1, wt))
        warm.serve(self.req(-2, wt + _tokens("warm2", 1000, self.cfg.vocab)))
        t_start = time.perf_counter()
        for k, req in enumerate(mine):
            if k % 16 == 0:
                print(f"  workload request {k}/{len(mine)} at {time.perf_counter() - t_start:.1f}s", flush=True)
            logits_of = {}
            for j in range(len(arms)):
                arm, lanes = arms[(k + j) % len(arms)]
                lane = lanes[(req.idx // workers) % len(lanes)]
                nvme = lane.tier is not None and lane.tier.spec.kind == "nvme"
                p0 = lane.tier.promotions() if nvme else 0
                if self.barrier is not None:
                    self.barrier.wait(timeout=600)
                r = lane.serve(req, keep_logits=True)
                if nvme:
                    r["nvme_tokens"] = (lane.tier.promotions() - p0) * self.cfg.page_size
                logits_of[arm] = r.pop("logits")
                r["worker"] = widx
                results[arm].append(r)
            # Every arm's first token and logits against the first arm's (GPU prefix cache only).
            ref = logits_of[names[0]]
            for arm in names[1:]:
                r = results[arm][-1]
                r["first_token_equal_ref"] = r["first_token"] == results[names[0]][-1]["first_token"]
                r["max_abs_logit_diff_ref"] = (logits_of[arm] - ref).abs().max().item()
        wall = time.perf_counter() - t_start
        finish = {}
        for arm, lanes in arms:
            finish[arm] = [ln.finish() for ln in lanes]
            self.close(*lanes)
        self.close(warm)
        return {"arms": names, "results": results, "finish": finish, "wall_s": wall,
                "worker": widx, "workers": workers, "requests": len(mine)}


def _summ(runs: List[Dict]) -> Dict:
    """Median run of a repeated measurement, with every run's TTFT."""
    runs = sorted(runs, key=lambda r: r["ttft_s"])
    med = dict(runs[len(runs) // 2])
    med.pop("logits", None)
    med["ttft_runs_s"] = [r["ttft_s"] for r in runs]
    med["ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
    return med


def fit_recompute_cost(x_short: float, t_short: float, x_long: float, t_long: float,
                       x_head: float, t_tail: float) -> Dict:
    """The daemon's recompute cost `T(c, x) = n / tokens_per_s + quad_s * n² + ctx_s * n * c`
    (n = x − c) from three timings: two full prefills `t_short = T(0, x_short)`, `t_long =
    T(0, x_long)` give tokens_per_s and quad_s; the tail `t_tail = T(x_head, x_long)` gives
    `ctx_s = (t_tail − n / tokens_per_s − quad_s * n²) / (n * x_head)`, n = x_long − x_head.
    Fallbacks: when the two prefills give tokens_per_s <= 0 or quad_s < 0 (noise), a linear
    fit through the long prefill (quad_s = 0, `fallback_linear`); when ctx_s is not positive
    (or there is no tail), 2 * quad_s, the daemon's default (`ctx_fallback`). Returns those
    figures and `T` (the fitted model, for predicted-vs-measured)."""
    x1, x2 = float(x_short), float(x_long)
    det = x1 * x2 * x2 - x2 * x1 * x1
    inv = quad = -1.0
    if det != 0:
        inv = (t_short * x2 * x2 - t_long * x1 * x1) / det
        quad = (x1 * t_long - x2 * t_short) / det
    fallback_linear = inv <= 0 or quad < 0
    if fallback_linear:
        inv, quad = t_long / x2, 0.0
    n, head = x2 - float(x_head), float(x_head)
    ctx = (t_tail - n * inv - quad * n * n) / (n * head) if n > 0 and head > 0 else 0.0
    ctx_fallback = not ctx > 0
    if ctx_fallback:
        ctx = 2.0 * quad

    def T(c: float, x: float) -> float:
        m = x - c
        return m * inv + quad * m * m + ctx * m * c

    return {"tokens_per_s": 1.0 / inv, "quad_s": quad, "ctx_s": ctx, "T": T,
            "fallback_linear": fallback_linear, "ctx_fallback": ctx_fallback}


def run(spec: Dict, out: str, barrier=None) -> Dict:
    res: Dict = {"spec": spec}
    try:
        w = Worker(spec, barrier)
        res["model_init_s"] = w.init_s
        if w.model.device.type == "cuda":
            res["device_name"] = torch.cuda.get_device_name(w.model.device)
        res["torch"] = torch.__version__
        tag = f"[worker {spec.get('worker_index', 0)}/{spec.get('workers', 1)}]"
        print(f"{tag} model {spec['model']} ready in {w.init_s:.1f}s", flush=True)
        for section in spec["sections"]:
            print(f"{tag} {section} ...", flush=True)
            t = time.perf_counter()
            try:
                res[section] = getattr(w, section)()
            except Exception as e:  # noqa: BLE001 - recorded; later sections still run
                res[section] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                if barrier is not None:
                    barrier.abort()
            res[section + "_s"] = time.perf_counter() - t
            err = res[section].get("error") if isinstance(res[section], dict) else None
            print(f"{tag} {section} done in {res[section + '_s']:.1f}s" + (f" ERROR {err}" if err else ""), flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1, default=str)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-3000:]
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res
