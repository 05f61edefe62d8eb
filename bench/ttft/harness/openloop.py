"""Open-loop serving of one arm: Poisson arrivals at a set rate, continuous batching, decode.

Requests arrive at seeded exponential gaps (the same times for every arm at one rate and
seed), whether or not the worker keeps up: a worker slower than the rate builds a queue, and
the queue is in its TTFT. The worker runs a serving engine's loop, one step at a time:

  prefill step  (when requests wait, fewer than `max_running` run, and the pool has room for
                the head of the queue) admit waiting requests in arrival order up to
                `max_prefill_tokens` new tokens: match each in the GPU prefix cache, fetch
                the next pages from the daemon (the arm's tier), allocate pages for the rest
                and for its decode, then ONE batched forward over all of them
                (harness/batched.py); each request's first token is on the host -> TTFT.
  decode step   otherwise, one token for every running request, batched; a request that has
                decoded `decode_tokens` tokens finishes and frees its pages.

Prefill-first, as vLLM schedules without chunked prefill. New full prompt pages are published
in the prefix cache and offloaded (arms with a tier) right after the prefill, as in closed loop.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import layerwise
from .batched import Seq, forward
from .decode import DecodeSeq, GraphDecoder
from .lane import Lane, sync
from .pool import PoolFull
from .workload import Request


@dataclass(frozen=True)
class OpenLoopConfig:
    rate: float                     # requests per second (Poisson)
    seed: int = 1                   # arrival seed
    decode_tokens: int = 32         # tokens generated after the first
    max_running: int = 8            # requests in flight per worker
    max_prefill_tokens: int = 16384 # new tokens per batched prefill step
    # decode step: "graph" (harness/decode.py: one paged-attention call per layer, CUDA graphs
    # per batch bucket on CUDA, eager on CPU) or "eager" (batched.forward: attention per sequence)
    decode: str = "graph"
    decode_attn: Optional[str] = None  # "triton" | "sdpa"; default triton on CUDA, sdpa on CPU
    worker_index: int = 0           # with several workers: this one serves requests i % workers
    workers: int = 1

    def check(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"open-loop rate must be > 0 requests/s, got {self.rate}")
        if self.decode_tokens < 0 or self.max_running < 1 or self.max_prefill_tokens < 1:
            raise ValueError("open loop needs decode_tokens >= 0, max_running >= 1, max_prefill_tokens >= 1")
        if self.decode not in ("graph", "eager"):
            raise ValueError(f"open-loop decode must be 'graph' or 'eager', got {self.decode!r}")
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(f"worker_index {self.worker_index} is not in 0 .. workers-1 ({self.workers})")


def arrivals(n: int, rate: float, seed: int) -> List[float]:
    """Arrival times (s from the start) of n requests of a Poisson process at `rate`."""
    r = random.Random(f"{seed}/arrivals/{rate}")
    t, out = 0.0, []
    for _ in range(n):
        t += r.expovariate(rate)
        out.append(t)
    return out


@dataclass
class _Req:
    req: Request
    arrival: float
    admit: float = 0.0
    gpu_pages: List[int] = field(default_factory=list)
    loaded: List[int] = field(default_factory=list)
    fresh: List[int] = field(default_factory=list)
    dup: List[int] = field(default_factory=list)
    published: List[int] = field(default_factory=list)
    ld: object = None
    lw: Optional[layerwise.LayeredLoad] = None
    fetch_s: float = 0.0
    ctx: int = 0
    last: int = 0
    decoded: int = 0
    row: Dict = field(default_factory=dict)

    @property
    def pages(self) -> List[int]:
        return self.gpu_pages + self.loaded + self.fresh


class OpenLoop:
    def __init__(self, lane: Lane, cfg: OpenLoopConfig):
        cfg.check()
        self.lane, self.cfg = lane, cfg
        self.ps = lane.model.cfg.page_size
        self.steps = {"prefill": 0, "decode": 0, "prefill_seqs": 0, "decode_seqs": 0, "pool_waits": 0,
                      "decode_s": 0.0, "prefill_s": 0.0}
        self.dec: Optional[GraphDecoder] = None

    # -- pool room -------------------------------------------------------------------------
    def _room(self) -> int:
        c = self.lane.cache
        return len(c.free) + sum(1 for p in c.owner if p not in c.pins)

    def _need(self, q: Request) -> int:
        return -(-(len(q.tokens) + self.cfg.decode_tokens) // self.ps)

    # -- prefill ---------------------------------------------------------------------------
    def _admit(self, r: _Req, now: float) -> None:
        ln, ps = self.lane, self.ps
        q = r.req
        r.admit = now
        digs = ln.digests(q)
        max_hit = (len(q.tokens) - 1) // ps
        t = time.perf_counter()
        r.gpu_pages = ln.cache.match(digs[:max_hit])
        ln.cache.pin(r.gpu_pages)
        if ln.tier is not None and len(r.gpu_pages) < max_hit:
            want = digs[len(r.gpu_pages):max_hit]
            if ln.tier.spec.layers:
                r.lw = layerwise.start(ln.tier, want, ln._alloc)
                r.loaded = list(r.lw.pages)
            else:
                r.ld, r.loaded = ln.tier.lookup_and_load(want, digs, ln._alloc, ln.cache.release,
                                                         start_pages=len(r.gpu_pages), prompt_tokens=len(q.tokens))
        have = len(r.gpu_pages) + len(r.loaded)
        r.fresh = ln._alloc(self._need(q) - have)
        r.fetch_s = time.perf_counter() - t

    def _seq(self, r: _Req) -> Seq:
        cached = (len(r.gpu_pages) + len(r.loaded)) * self.ps
        return Seq(torch.tensor(r.req.tokens[cached:], dtype=torch.long), cached,
                   torch.tensor(r.pages, dtype=torch.long))

    def _prefill(self, batch: List[_Req], t0: float) -> List[_Req]:
        ln, ps = self.lane, self.ps
        lws = [r.lw for r in batch if r.lw is not None and r.lw.pages]

        def wait(layer: int) -> None:
            for lw in lws:
                lw.wait(layer)

        tp = time.perf_counter()
        logits = forward(ln.model, [self._seq(r) for r in batch], ln.pool, wait if lws else None)
        firsts = torch.argmax(logits, dim=-1).tolist()  # host sync: the tokens are on the host
        t_first = time.perf_counter() - t0
        prefill_s = t_first + t0 - tp
        for i, r in enumerate(batch):
            redo = 0
            if r.lw is not None and r.lw.pages:
                got = r.lw.finish()
                if got < len(r.loaded):  # pages that did not land: recompute from the first
                    redo = len(r.loaded) - got
                    r.fresh = r.loaded[got:] + r.fresh
                    r.loaded = r.loaded[:got]
                    firsts[i] = int(torch.argmax(forward(ln.model, [self._seq(r)], ln.pool)[0]).item())
            self._publish(r)
            q = r.req
            cached = (len(r.gpu_pages) + len(r.loaded)) * ps
            r.ctx, r.last = len(q.tokens), firsts[i]
            r.row = {"idx": q.idx, "session": q.session, "turn": q.turn, "prompt_tokens": len(q.tokens),
                     "arrival_s": r.arrival, "queue_s": r.admit - r.arrival,
                     "ttft_s": (time.perf_counter() - t0 if redo else t_first) - r.arrival,
                     "fetch_s": r.fetch_s, "prefill_s": prefill_s, "batch_seqs": len(batch),
                     "computed_tokens": len(q.tokens) - cached, "gpu_hit_tokens": len(r.gpu_pages) * ps,
                     "tier_hit_tokens": len(r.loaded) * ps, "first_token": firsts[i]}
            moved = len(r.loaded) * ln.model.cfg.page_bytes
            if r.ld is not None:
                r.row.update({"lookup_s": r.ld.lookup_s, "stage_s": r.ld.stage_s, "onload_s": r.ld.onload_s,
                              "pulled_tokens": r.ld.pulled * ps, "moved_bytes": moved})
            if r.lw is not None:
                r.row.update({"lookup_s": r.lw.lookup_s, "stage_s": 0.0, "onload_s": r.lw.onload_s,
                              "layer_wait_s": r.lw.wait_s, "layerwise_redo_pages": redo, "moved_bytes": moved})
        self.steps["prefill"] += 1
        self.steps["prefill_seqs"] += len(batch)
        self.steps["prefill_s"] += prefill_s
        return batch

    def _publish(self, r: _Req) -> None:
        """Loaded pages and new full prompt pages into the prefix cache; offload the new ones."""
        ln, ps = self.lane, self.ps
        digs = ln.digests(r.req)
        base = len(r.gpu_pages)
        for d, p in zip(digs[base:], r.loaded):
            if d in ln.cache.table:  # a page left over from a broken chain
                r.dup.append(p)
            else:
                ln.cache.insert(d, p)
        new = []
        have = base + len(r.loaded)
        for i, p in enumerate(r.fresh):
            gi = have + i
            if gi < len(digs) and (gi + 1) * ps <= len(r.req.tokens) and digs[gi] not in ln.cache.table:
                ln.cache.insert(digs[gi], p)
                new.append((digs[gi], p))
        r.published = [p for _, p in new]
        if ln.tier is not None and new:
            ln.cache.pin(r.published)  # unpinned by the offload's drain
            ln.tier.offload_async([d for d, _ in new], r.published)

    # -- decode ----------------------------------------------------------------------------
    def _decode(self, running: List[_Req]) -> None:
        t = time.perf_counter()
        if self.dec is not None:
            nxt = self.dec.step([DecodeSeq(r.last, r.ctx, r.pages) for r in running])
        else:
            seqs = [Seq(torch.tensor([r.last], dtype=torch.long), r.ctx, torch.tensor(r.pages, dtype=torch.long))
                    for r in running]
            nxt = torch.argmax(forward(self.lane.model, seqs, self.lane.pool), dim=-1).tolist()
        self.steps["decode_s"] += time.perf_counter() - t
        for r, t in zip(running, nxt):
            r.last, r.ctx, r.decoded = t, r.ctx + 1, r.decoded + 1
        self.steps["decode"] += 1
        self.steps["decode_seqs"] += len(running)

    def _finish(self, r: _Req, now: float) -> None:
        c = self.lane.cache
        c.unpin([p for p in r.gpu_pages + r.loaded if p not in r.dup] + r.published)
        c.release(r.dup)
        c.release([p for p in r.fresh if p not in c.owner])
        r.row["done_s"] = now - r.arrival
        r.row["output_tokens"] = 1 + r.decoded

    # -- the loop --------------------------------------------------------------------------
    def run(self, requests: List[Request], barrier=None) -> Dict:
        """Serves the stream (this worker's share of it: requests i % workers == worker_index,
        at the full stream's arrival times). `barrier`: all workers start their clocks together."""
        cfg, ln = self.cfg, self.lane
        times = arrivals(len(requests), cfg.rate, cfg.seed)
        for q in requests:
            if self._need(q) > ln.pool.pages:
                raise PoolFull(f"request {q.idx} needs {self._need(q)} pages; the pool has {ln.pool.pages}")
        if cfg.decode == "graph" and cfg.decode_tokens > 0:
            most = max(self._need(q) for q in requests)
            self.dec = GraphDecoder(ln.model, ln.pool, most, cfg.max_running, attn=cfg.decode_attn)
        offered = len(requests) / times[-1] if times and times[-1] > 0 else None
        pending = [_Req(q, t) for i, (q, t) in enumerate(zip(requests, times))
                   if i % cfg.workers == cfg.worker_index]
        pending.reverse()
        waiting: List[_Req] = []
        running: List[_Req] = []
        done: List[_Req] = []
        sync(ln.model.device)
        if barrier is not None:
            barrier.wait(timeout=600)
        t0 = time.perf_counter()
        while pending or waiting or running:
            now = time.perf_counter() - t0
            while pending and pending[-1].arrival <= now:
                waiting.append(pending.pop())
            ln._drain()
            if waiting and len(running) < cfg.max_running and self._room() >= self._need(waiting[0].req):
                batch, tokens = [], 0
                while (waiting and len(running) + len(batch) < cfg.max_running
                       and (not batch or tokens + len(waiting[0].req.tokens) <= cfg.max_prefill_tokens)
                       and self._room() >= self._need(waiting[0].req)):
                    r = waiting.pop(0)
                    self._admit(r, now)
                    batch.append(r)
                    tokens += len(r.req.tokens)
                for r in self._prefill(batch, t0):
                    if cfg.decode_tokens == 0:
                        self._finish(r, time.perf_counter() - t0)
                        done.append(r)
                    else:
                        running.append(r)
            elif running:
                self._decode(running)
                t = time.perf_counter() - t0
                for r in [r for r in running if r.decoded >= cfg.decode_tokens]:
                    running.remove(r)
                    self._finish(r, t)
                    done.append(r)
            elif waiting:  # nothing runs, and offloads in flight pin the pages the head needs
                self.steps["pool_waits"] += 1
                ln._drain(wait=True)
                if self._room() < self._need(waiting[0].req):
                    raise PoolFull(f"request {waiting[0].req.idx} cannot fit in an idle pool")
            else:
                time.sleep(max(0.0, min(pending[-1].arrival - now, 0.05)))
        wall = time.perf_counter() - t0
        rows = sorted((r.row for r in done), key=lambda x: x["arrival_s"])
        out_tokens = sum(r["output_tokens"] for r in rows)
        dec = None if self.dec is None else {"attn": self.dec.attn, "graphs": self.dec.graphs,
                                             "capture_s": self.dec.capture_s, "buckets": list(self.dec.buckets),
                                             "max_pages": self.dec.max_pages}
        return {"rows": rows, "wall_s": wall, "rate": cfg.rate, "requests": len(rows),
                "offered_req_per_s": offered, "last_arrival_s": times[-1] if times else None,
                "decoder": dec,
                "achieved_req_per_s": len(rows) / wall if wall else None,
                "output_tok_per_s": out_tokens / wall if wall else None,
                "steps": dict(self.steps), "config": cfg.__dict__}
