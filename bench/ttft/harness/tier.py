"""A worker's view of its node daemon: look up a prefix, load it into pool pages, offload new pages.

Paths (`kind`):
  dram  Exists, then Onload of the leading run (the daemon's CUDA DMA from its pinned arena).
  nvme  Exists counts blocks on either tier; Get(Lease) promotes NVMe-only blocks into DRAM,
        then Onload; chunks are pipelined (the next chunk's promotion overlaps this chunk's DMA).
  peer  Like dram, but when the router knows another daemon holds more of the prefix than the
        local daemon, a Get(Lease) carrying a hint (source endpoint + root-aligned block hashes)
        pulls the missing pages over TCP into the local DRAM tier first.
With `TierSpec.plan` (the engine's recompute cost, kvnode.plan) the lookup is the engines'
fetch-or-recompute lookup (issue 41): `Exists` carries the cost (and, for a peer, the router hint;
the daemon pulls only if its plan takes the peer, and the lookup waits for that pull like
kvnode.common.hinted_exists), and only the plan's leading pages are loaded; the lane recomputes
the rest.
Offloads of new full pages run on a background thread with their own connection; completed
page lists come back through `drain()` so the caller's prefix cache is only touched by its
own thread.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvnode.common import hinted_exists, pull_budget_ms
from kvnode.gpu import leading
from kvnode.plan import Plan, RecomputeCost
from kvnode.wire import Connection, KvnodeError

from .movers import make_mover
from .pool import KvPool
from .workload import hint_hash

KINDS = ("dram", "nvme", "peer")


@dataclass
class Load:
    """What one lookup + load did."""

    pages: int = 0            # leading pages loaded into the pool
    lookup_s: float = 0.0     # Exists
    stage_s: float = 0.0      # NVMe promotion or peer pull (Get with lease)
    onload_s: float = 0.0     # Onload (DMA) after staging
    pulled: int = 0           # pages that came from the peer
    local: int = 0            # pages that were in the local daemon already
    pull_report: Optional[dict] = None
    plan: Optional[dict] = None    # the daemon's fetch plan (TierSpec.plan), as answered


class Router:
    """Which daemon endpoint holds each page digest (filled from completed offloads)."""

    def __init__(self):
        self.holder: Dict[bytes, str] = {}

    def leading_run(self, digests: Sequence[bytes]) -> int:
        n = 0
        for d in digests:
            if d not in self.holder:
                break
            n += 1
        return n


@dataclass
class TierSpec:
    sock: str
    kind: str = "dram"
    mover: str = "dma"
    ns_name: str = "ttft"
    endpoint: str = ""            # this daemon's peer endpoint (peer kind)
    chunk_pages: int = 64         # pages per staged chunk (nvme / peer)
    offload_chunk: int = 16       # nvme: pages per Offload, each after DRAM has room for it
    pull_deadline_ms: int = 30000
    layers: int = 0               # dram: > 0 = layer-wise onload overlapped with the prefill (harness/layerwise.py)
    stream_pull: bool = False     # peer: one hinted OnloadAsync; each page goes to the GPU as it lands
    plan: dict = field(default_factory=dict)  # {"tokens_per_s", "quad_s", "ctx_s"?}: fetch plans (issue 41)
    extra: dict = field(default_factory=dict)


class DaemonTier:
    def __init__(self, spec: TierSpec, pool: KvPool, router: Optional[Router] = None,
                 client: str = "ttft"):
        if spec.kind not in KINDS:
            raise ValueError(f"unknown tier kind {spec.kind!r}; use one of {KINDS}")
        self.spec, self.pool, self.router = spec, pool, router
        cfg = pool.cfg
        self.conn = Connection(spec.sock, client=client)
        self.mover = make_mover(spec.mover, self.conn, pool)
        nsspec = {"model": spec.ns_name, "page_size": cfg.page_size, "dtype": "bf16",
                  "layout": pool.layout, "kv_shape": [cfg.layers, cfg.kv_heads, cfg.head_dim],
                  "segments": [cfg.page_bytes]}
        self.ns = self.conn.register(nsspec)["ns"]
        try:
            self.timeouts = self.conn.call("Timeouts")[1]
        except KvnodeError:
            self.timeouts = None
        self._off_q: "queue.Queue" = queue.Queue()
        self._done_q: "queue.Queue" = queue.Queue()
        self.offload_shared = False
        try:
            self._off_conn = Connection(spec.sock, client=client + "-offload")
            self._off_mover = make_mover(spec.mover, self._off_conn, pool)
            self._off_ns = self._off_conn.register(nsspec)["ns"]
        except Exception:  # noqa: BLE001 - a second IPC open of one allocation may be refused
            self._off_conn, self._off_mover, self._off_ns = self.conn, self.mover, self.ns
            self.offload_shared = True
        self._lock = threading.Lock()
        self.offload_bytes = 0
        self.offload_s = 0.0
        self.offload_pages = 0
        self.offload_errors: List[str] = []
        self.room_wait_s = 0.0
        self._t = threading.Thread(target=self._offloader, daemon=True)
        self._t.start()

    # -- lookup and load -------------------------------------------------------------------
    @staticmethod
    def keys(digests: Sequence[bytes]) -> List[list]:
        return [[d, 0] for d in digests]

    def _call(self, fn: Callable, *a):
        if self.offload_shared:
            with self._lock:
                return fn(*a)
        return fn(*a)

    def _hint_to(self, endpoint: str, root: Sequence[bytes]) -> str:
        return json.dumps({"source_control_endpoint": endpoint,
                           "block_hashes": [hint_hash(d) for d in root]})

    def _planned(self, ld: Load, digests: Sequence[bytes], root: Sequence[bytes], start_pages: int,
                 prompt_tokens: Optional[int] = None) -> int:
        """The fetch-or-recompute lookup: pages worth loading by the daemon's plan (a hinted
        pull it planned has been waited for; the pulled pages are then local). The cost sent
        carries `ctx_s` when the spec's plan has one and the prompt's length (`prompt_tokens`)."""
        p = self.spec.plan
        ctx = p.get("ctx_s")
        cost = RecomputeCost(float(p["tokens_per_s"]), float(p.get("quad_s", 0.0)),
                             None if ctx is None else float(ctx))
        ps = self.pool.cfg.page_size
        via = "gpu" if self.spec.mover != "copy" else "copy"
        fields = cost.wire(ps, 1, start_tokens=start_pages * ps, via=via, prompt_tokens=prompt_tokens)
        keys = self.keys(digests)
        hinted = None
        if self.spec.kind == "peer" and self.router is not None:
            others = {self.router.holder[d] for d in digests if d in self.router.holder} - {self.spec.endpoint}
            if others:
                hinted = sorted(others)[0]
        t = time.perf_counter()
        if hinted:
            fields["hint"] = self._hint_to(hinted, root)
            budget = pull_budget_ms(self.timeouts, len(keys), cap_s=self.spec.pull_deadline_ms / 1e3)
            found = self._call(hinted_exists, self.conn, self.ns, keys, fields, budget)
            n, plan = found.count, found.plan
            if found.waited:
                ld.pull_report = {k: (found.report or {}).get(k) for k in ("state", "leading", "peer", "reason", "elapsed_ms")}
                ld.pulled = n
        else:
            _, body, _ = self._call(self.conn.call, {"Exists": {"ns": self.ns, "keys": keys, **fields}})
            plan = Plan.of(body)
            n = int(body["count"]) if plan is None else min(int(body["count"]), plan.keys)
        ld.lookup_s = time.perf_counter() - t
        if plan is not None:
            ld.plan = {"keys": plan.keys, "available": plan.available, "reason": plan.reason,
                       "cut_by": plan.cut_by, "fetch_s": plan.fetch_s, "recompute_s": plan.recompute_s,
                       "runs": [list(r) for r in plan.runs], "note": plan.note}
        return n

    def lookup_and_load(self, digests: Sequence[bytes], root: Sequence[bytes],
                        alloc: Callable[[int], List[int]], release: Callable[[List[int]], None],
                        start_pages: int = 0, prompt_tokens: Optional[int] = None) -> Tuple[Load, List[int]]:
        """Loads the leading run of `digests` the daemon (or, by hint, its peer) holds.

        `root`: every page digest of the prompt from page 0 (hint hashes are root-aligned).
        `alloc(n)` gives n pinned pool pages; pages not filled are handed to `release`.
        `start_pages`: pages before `digests[0]` the engine holds (the plan's start_tokens).
        `prompt_tokens`: the request's prompt length (the plan's prompt_tokens: where the
        recompute ends).
        Returns the Load and the filled page ids (in order).
        """
        ld = Load()
        keys = self.keys(digests)
        if self.spec.plan:
            want = self._planned(ld, digests, root, start_pages, prompt_tokens)
            ld.local = want - ld.pulled
            if want == 0:
                return ld, []
            pages = alloc(want)
            try:  # the planned pages are local now (DRAM or NVMe): the staged path loads them
                got = (self._stage_and_onload(ld, keys[:want], pages, root, None) if self.spec.kind == "nvme"
                       else self._dram_onload(ld, keys[:want], pages))
            except BaseException:
                release(pages)
                raise
            release(pages[got:])
            ld.pages = got
            ld.pulled = min(ld.pulled, got)
            ld.local = got - ld.pulled
            return ld, pages[:got]
        t = time.perf_counter()
        n = self._call(self.conn.exists, self.ns, keys)
        ld.lookup_s = time.perf_counter() - t
        want = n
        hinted = None
        if self.spec.kind == "peer" and self.router is not None:
            r = self.router.leading_run(digests)
            others = {self.router.holder[d] for d in digests[n:r]} - {self.spec.endpoint}
            if r > n and others:
                hinted = sorted(others)[0]
                want = r
        ld.local = n
        if want == 0:
            return ld, []
        pages = alloc(want)
        try:
            got = self._stage_and_onload(ld, keys[:want], pages, root, hinted)
        except BaseException:
            release(pages)
            raise
        release(pages[got:])
        ld.pages = got
        if hinted:
            ld.pulled = max(0, got - n)
            ld.local = min(n, got)
        else:
            ld.local = got
        return ld, pages[:got]

    def _dram_onload(self, ld: Load, keys, pages) -> int:
        t = time.perf_counter()
        res = self._call(self.mover.onload, self.ns, keys, pages)
        ld.onload_s = time.perf_counter() - t
        return leading(res)

    def _stage_and_onload(self, ld: Load, keys, pages, root, hinted: Optional[str]) -> int:
        if self.spec.kind == "dram" or (self.spec.kind == "peer" and not hinted):
            return self._dram_onload(ld, keys, pages)
        extra = {}
        if hinted:
            extra = {"hint": self._hint_to(hinted, root), "deadline_ms": self.spec.pull_deadline_ms}
        if hinted and self.spec.stream_pull:
            return self._stream_onload(ld, keys, pages, extra)
        # Staged: Get(Lease) a chunk (promotion or hinted pull), Onload it, release the lease.
        # The next chunk is staged while this chunk's DMA runs (OnloadAsync).
        total, cp = 0, max(1, self.spec.chunk_pages)
        pending = None  # (ticket, lease, hits) of the chunk whose DMA is in flight
        for i in range(0, len(keys), cp):
            ck, cpg = keys[i:i + cp], pages[i:i + cp]
            t = time.perf_counter()
            lease, hits = self._get_lease(ck, extra, ld)
            ld.stage_s += time.perf_counter() - t
            if pending:
                got, ok = self._finish(ld, pending)
                total += got
                pending = None
                if not ok:
                    hits = 0
            if hits == 0:
                if lease:
                    self._call(self.conn.release, lease)
                return total
            t = time.perf_counter()
            ticket = self._call(self.mover.onload_async, self.ns, ck[:hits], cpg[:hits])
            ld.onload_s += time.perf_counter() - t
            pending = (ticket, lease, hits)
            if hits < len(ck):
                break
        if pending:
            total += self._finish(ld, pending)[0]
        return total

    def _stream_onload(self, ld: Load, keys, pages, extra) -> int:
        """One hinted onload: the daemon pulls what it lacks and copies each page into the pool
        as soon as its block has landed verified (the DMA overlaps the pull). Its whole time is
        onload_s; stage_s stays 0 (there is no separate staging step)."""
        if not hasattr(self.mover, "onload_pulled_async"):
            raise ValueError(f"stream_pull needs a DMA mover (dma or file-dma), not {self.spec.mover!r}")
        t = time.perf_counter()
        ticket = self._call(self.mover.onload_pulled_async, self.ns, keys, pages,
                            extra["hint"], extra["deadline_ms"])
        res, pull = self._call(self.mover.onload_pulled_wait, ticket)
        ld.onload_s = time.perf_counter() - t
        if pull:
            ld.pull_report = {k: pull.get(k) for k in ("state", "leading", "peer", "reason", "elapsed_ms")}
        return leading(res)

    def _finish(self, ld: Load, pending) -> Tuple[int, bool]:
        ticket, lease, hits = pending
        t = time.perf_counter()
        res = self._call(self.mover.onload_wait, ticket)
        ld.onload_s += time.perf_counter() - t
        if lease:
            self._call(self.conn.release, lease)
        got = leading(res)
        return got, got == hits

    def _get_lease(self, keys, extra, ld: Load):
        op = {"ns": self.ns, "keys": keys, "mode": "Lease", **(extra or {})}
        _, body, _ = self._call(self.conn.call, {"Get": op})
        ext = body["extents"]
        if body.get("pull"):
            ld.pull_report = {k: body["pull"].get(k) for k in ("state", "leading", "peer", "reason", "elapsed_ms")}
        hits = 0
        for e in ext:
            if e is None:
                break
            hits += 1
        return body["lease"], hits

    # -- offload ---------------------------------------------------------------------------
    def offload_async(self, digests: Sequence[bytes], pages: Sequence[int]) -> None:
        """Queues new full pages; they come back from drain() once copied (or refused)."""
        self._off_q.put((list(digests), list(pages)))

    def _offloader(self) -> None:
        while True:
            item = self._off_q.get()
            if item is None:
                return
            if item[0] == "flush":
                item[1].set()
                continue
            digests, pages = item
            t = time.perf_counter()
            res = []
            step = self._offload_step() if self.spec.kind == "nvme" else len(pages)
            for i in range(0, len(pages), max(1, step)):
                d, p = digests[i:i + step], pages[i:i + step]
                try:
                    if self.spec.kind == "nvme":
                        self._wait_room(len(p) * self.pool.cfg.page_bytes)
                    res += self._call(self._off_mover.offload, self._off_ns, self.keys(d), p)
                except Exception as e:  # noqa: BLE001 - reported in the results, pages still unpinned
                    res += ["Error"] * len(p)
                    self.offload_errors.append(str(e))
            dt = time.perf_counter() - t
            stored = sum(1 for r in res if r == "Stored")
            self.offload_s += dt
            self.offload_pages += stored
            self.offload_bytes += stored * self.pool.cfg.page_bytes
            if self.router is not None:
                for d, r in zip(digests, res):
                    if r in ("Stored", "Exists"):
                        self.router.holder.setdefault(d, self.spec.endpoint)
            self._done_q.put(pages)

    def _offload_step(self) -> int:
        """Pages per paced Offload: what the demoter keeps free (5 % of DRAM, its low watermark)."""
        if not hasattr(self, "_step"):
            st = self._call(self._off_conn.stats)
            cap = next(t for t in st["tiers"] if t["tier"] == "dram")["capacity_bytes"]
            self._step = max(1, min(self.spec.offload_chunk, int(cap * 0.05) // self.pool.cfg.page_bytes))
        return self._step

    def _wait_room(self, need: int, timeout_s: float = 5.0) -> None:
        """Waits until the DRAM tier has `need` free bytes (its demoter writes to NVMe meanwhile).

        The daemon's GPU Offload reserves slots without waiting for demotions (a Put waits up to
        room_wait_ms), so an offload burst larger than the free DRAM would evict blocks before
        they reach NVMe ("dropped"). Pacing here keeps the NVMe tier complete; the wait is off
        the TTFT path (background thread) and reported as offload_room_waits_s.
        """
        t0 = time.perf_counter()
        while True:
            st = self._call(self._off_conn.stats)
            dram = next(t for t in st["tiers"] if t["tier"] == "dram")
            if dram["capacity_bytes"] - dram["slot_bytes"] >= need or time.perf_counter() - t0 > timeout_s:
                break
            time.sleep(0.005)
        self.room_wait_s += time.perf_counter() - t0

    def drain(self, wait: bool = False) -> List[int]:
        """Pages whose offload finished (to unpin). With `wait`, first waits for every queued one."""
        if wait:
            ev = threading.Event()
            self._off_q.put(("flush", ev))
            if not ev.wait(timeout=300):
                raise TimeoutError("offloads did not finish in 300 s")
        out: List[int] = []
        while True:
            try:
                out.extend(self._done_q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._off_q.put(None)
        self._t.join(timeout=30)
        if not self.offload_shared:
            self._off_conn.close()
        self.conn.close()

    def promotions(self) -> int:
        """DRAM tier promotions (NVMe -> DRAM) so far."""
        for t in self._call(self.conn.stats)["tiers"]:
            if t["tier"] == "dram":
                return t.get("promotions", 0)
        return 0
