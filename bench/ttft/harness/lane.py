"""One arm's worker: a KV pool, its GPU prefix cache, optionally a daemon tier; serves requests.

serve(): match the prompt's pages in the GPU prefix cache; on a miss ask the tier for the
next pages (onload into fresh pool pages); prefill the rest; the first token is the argmax
of the last position's logits. TTFT is measured from the request's arrival at the worker
to that token being on the host (torch.cuda.synchronize). After TTFT, the new full pages
are published in the prefix cache and, with a tier, offloaded asynchronously (pinned until
the offload completed). At least one token is always computed: a prompt that is all full
cached pages recomputes its last page, as engines do.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from . import layerwise
from .model import Decoder
from .pool import KvPool, PoolFull, PrefixCache
from .tier import DaemonTier
from .workload import Request, page_digests


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Lane:
    def __init__(self, name: str, model: Decoder, pool: KvPool, tier: Optional[DaemonTier] = None):
        self.name, self.model, self.pool, self.tier = name, model, pool, tier
        self.cache = PrefixCache(pool.pages)
        self._digests: Dict[tuple, List[bytes]] = {}
        self.stalls = 0  # allocations that waited for offloads to unpin pages

    def digests(self, req: Request) -> List[bytes]:
        key = (req.idx, len(req.tokens), tuple(req.tokens[-4:]))
        d = self._digests.get(key)
        if d is None:
            d = page_digests(req.tokens, self.model.cfg.page_size)
            self._digests[key] = d
        return d

    def _drain(self, wait: bool = False) -> None:
        if self.tier is not None:
            self.cache.unpin(self.tier.drain(wait))

    def _alloc(self, n: int) -> List[int]:
        """Pool pages; when in-flight offloads pin too much, waits for them (backpressure, timed)."""
        try:
            return self.cache.alloc(n)
        except PoolFull:
            if self.tier is None:
                raise
            self.stalls += 1
            self._drain(wait=True)
            return self.cache.alloc(n)

    def serve(self, req: Request, keep_logits: bool = False) -> Dict:
        ps = self.model.cfg.page_size
        dev = self.model.device
        self._drain()
        digs = self.digests(req)
        n_tok = len(req.tokens)
        max_hit = (n_tok - 1) // ps  # leave at least one token to compute
        sync(dev)
        t0 = time.perf_counter()
        gpu_pages = self.cache.match(digs[:max_hit])
        self.cache.pin(gpu_pages)
        loaded: List[int] = []
        dup: List[int] = []
        ld = lw = None
        if self.tier is not None and len(gpu_pages) < max_hit:
            if self.tier.spec.layers:  # layer-wise: the onload runs under the prefill
                lw = layerwise.start(self.tier, digs[len(gpu_pages):max_hit], self._alloc)
                loaded = list(lw.pages)
            else:
                ld, loaded = self.tier.lookup_and_load(
                    digs[len(gpu_pages):max_hit], digs, self._alloc, self.cache.release,
                    start_pages=len(gpu_pages), prompt_tokens=n_tok)
        t_fetch = time.perf_counter()
        have = gpu_pages + loaded
        cached = len(have) * ps
        fresh = self._alloc(-(-n_tok // ps) - len(have))
        tokens = torch.tensor(req.tokens[cached:], dtype=torch.long)
        wait = lw.wait if lw is not None and lw.pages else None
        logits = self.model.prefill(tokens, cached, torch.tensor(have + fresh, dtype=torch.long), self.pool, wait)
        redo = 0
        if wait is not None:
            got = lw.finish()
            if got < len(loaded):
                # Pages that did not land hold no valid KV: recompute from the first of them
                # (they become computed pages, written in place by this second prefill).
                redo = len(loaded) - got
                fresh = loaded[got:] + fresh
                loaded = loaded[:got]
                have = gpu_pages + loaded
                cached = len(have) * ps
                tokens = torch.tensor(req.tokens[cached:], dtype=torch.long)
                logits = self.model.prefill(tokens, cached, torch.tensor(have + fresh, dtype=torch.long), self.pool)
        for d, p in zip(digs[len(gpu_pages):], loaded):
            if d in self.cache.table:  # a page left over from a broken chain
                dup.append(p)
            else:
                self.cache.insert(d, p)
        first = int(torch.argmax(logits).item())  # host sync: the token is on the host
        t1 = time.perf_counter()
        # Publish new full pages; offload them; free the partial tail.
        full_new = []
        for i, p in enumerate(fresh):
            gi = len(have) + i
            if gi < len(digs) and digs[gi] not in self.cache.table:
                self.cache.insert(digs[gi], p)
                full_new.append((digs[gi], p))
        tail = [p for p in fresh if p not in self.cache.owner]
        self.cache.release(tail)
        self.cache.unpin([p for p in have if p not in dup] + [p for _, p in full_new])
        self.cache.release(dup)
        if self.tier is not None and full_new:
            pages = [p for _, p in full_new]
            self.cache.pin(pages)
            self.tier.offload_async([d for d, _ in full_new], pages)
        out = {
            "lane": self.name, "idx": req.idx, "session": req.session, "turn": req.turn,
            "prompt_tokens": n_tok, "ttft_s": t1 - t0, "fetch_s": t_fetch - t0,
            "prefill_s": t1 - t_fetch, "computed_tokens": n_tok - cached,
            "gpu_hit_tokens": len(gpu_pages) * ps, "tier_hit_tokens": len(loaded) * ps,
            "first_token": first,
        }
        if lw is not None:
            out.update({"lookup_s": lw.lookup_s, "stage_s": 0.0, "onload_s": lw.onload_s,
                        "layerwise": True, "layer_wait_s": lw.wait_s, "onload_start_s": lw.start_s,
                        "layers_landed_s": lw.landed_s,
                        "layerwise_redo_pages": redo, "local_tier_tokens": len(loaded) * ps,
                        "moved_bytes": len(loaded) * self.model.cfg.page_bytes})
        if ld is not None:
            out.update({"lookup_s": ld.lookup_s, "stage_s": ld.stage_s, "onload_s": ld.onload_s,
                        "pulled_tokens": ld.pulled * ps, "local_tier_tokens": ld.local * ps,
                        "moved_bytes": ld.pages * self.model.cfg.page_bytes})
            if ld.pull_report:
                out["pull"] = ld.pull_report
            if ld.plan is not None:
                out["plan"] = ld.plan
        if keep_logits:
            out["logits"] = logits
        return out

    def finish(self) -> Dict:
        """Waits for queued offloads; returns the lane's offload totals."""
        if self.tier is None:
            return {}
        self._drain(wait=True)
        t = self.tier
        return {"offload_pages": t.offload_pages, "offload_bytes": t.offload_bytes,
                "offload_s": t.offload_s, "offload_errors": t.offload_errors[:5],
                "offload_shared_conn": t.offload_shared, "gpu_evictions": self.cache.evictions,
                "pool_full_stalls": self.stalls, "offload_room_waits_s": t.room_wait_s}
