"""Loads and stores between the daemon and vLLM's primary tier, on transfer threads (no vllm import).

`submit_store` / `submit_load` only queue a job; each of `threads` threads owns one daemon
connection (and its attachments of the primary tier's files) and runs jobs one at a time:

- zero copy (`region`): one `GetToRegion` / `PutFromRegion` per job and file; the daemon copies
  rows straight between its tier and the primary tier's pages;
- `arena`: the bytes cross the daemon's arena mapping once (`Get` lease + memmove + `Release`,
  `Alloc` + memmove + `Commit`), for primary memory the daemon cannot map.

A row counts as loaded only if the daemon wrote exactly one row of bytes into it; anything else
(a miss, a short block, a checksum failure on the NVMe tier, a dead or frozen daemon) fails that
key and vLLM recomputes it. A failed call fails every key of the job and drops the connection
(the next job reconnects).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from kvnode import transfer
from kvnode.outcomes import stored
from kvnode.vllm_tier.namespace import split_key, wire_key
from kvnode.vllm_tier.primary import Extent, locate
from kvnode.wire import Connection, KvnodeError, Region

logger = logging.getLogger("kvnode.vllm_tier")


@dataclass
class Job:
    job_id: int
    is_load: bool
    keys: List[bytes]
    chunk_ids: List[int]
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    job_id: int
    is_load: bool
    ok: List[bool]
    seconds: float
    nbytes: int
    reason: Optional[str] = None


class _Lane:
    """One transfer thread's daemon connection and region attachments."""

    def __init__(self) -> None:
        self.conn: Optional[Connection] = None
        self.ns = 0
        self.regions: Dict[int, Region] = {}

    def drop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn, self.regions = None, {}


class Transfers:
    """The job queue and its threads. `finished()` and `drain()` are for the scheduler thread."""

    def __init__(self, connect: Callable[[], Connection], register: Callable[[Connection], int],
                 nseg: int, row: int, base: int, extents: Sequence[Extent], threads: int):
        self._connect, self._register = connect, register
        self._nseg, self._row, self._base = nseg, row, base
        self._extents = list(extents)
        self._q: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._done: "queue.SimpleQueue[Outcome]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._open = 0  # submitted, outcome not yet queued
        self._threads = [threading.Thread(target=self._run, name=f"kvnode-tier-io-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def zero_copy(self) -> bool:
        return bool(self._extents)

    # -- scheduler thread ------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            self._open += 1
        self._q.put(job)

    def finished(self) -> List[Outcome]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> int:
        with self._cv:
            return self._open

    def drain(self) -> None:
        """Blocks until every submitted job has an outcome (a call in flight is never cut)."""
        with self._cv:
            self._cv.wait_for(lambda: self._open == 0)

    def close(self) -> None:
        self.drain()
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    # -- transfer threads ------------------------------------------------------------------
    def _run(self) -> None:
        lane = _Lane()
        while True:
            job = self._q.get()
            if job is None:
                lane.drop()
                return
            t0 = time.perf_counter()
            reason = None
            try:
                ok = self._execute(lane, job)
            except Exception as e:  # noqa: BLE001 - every job must end with an outcome
                ok, reason = [False] * len(job.keys), str(e)
                if not isinstance(e, (KvnodeError, OSError)):
                    logger.exception("kvnode tier: unexpected error in a transfer job")
                logger.warning("kvnode tier %s job %d failed (%s)", "load" if job.is_load else "store",
                               job.job_id, e)
                lane.drop()
            dt = time.perf_counter() - t0
            self._done.put(Outcome(job.job_id, job.is_load, ok, dt, sum(ok) * self._row, reason))
            with self._cv:
                self._open -= 1
                self._cv.notify_all()

    def _lane_conn(self, lane: _Lane) -> Connection:
        if lane.conn is None:
            lane.conn = self._connect()
            lane.ns = self._register(lane.conn)
        return lane.conn

    def _region(self, lane: _Lane, i: int) -> Region:
        r = lane.regions.get(i)
        if r is None:
            e = self._extents[i]
            r = lane.regions[i] = lane.conn.attach_region(e.fd, _file_len(e))
        return r

    def _execute(self, lane: _Lane, job: Job):
        row, n = self._row, len(job.keys)
        ok = [False] * n
        valid = [j for j, k in enumerate(job.keys) if split_key(k)[1] < self._nseg]
        if not valid:
            return ok
        c = self._lane_conn(lane)
        keys = [wire_key(job.keys[j]) for j in valid]
        offs = [int(job.chunk_ids[j]) * row for j in valid]
        if not self._extents:
            ptrs, sizes = [self._base + o for o in offs], [row] * len(valid)
            if job.is_load:
                flags = transfer.copy_in(c, lane.ns, keys, ptrs, sizes)
            else:
                flags = transfer.copy_out(c, lane.ns, keys, ptrs, sizes)
            for j, f in zip(valid, flags):
                ok[j] = bool(f)
            return ok
        by_ext: Dict[int, List[int]] = {}
        spot: Dict[int, int] = {}
        for idx, (j, o) in enumerate(zip(valid, offs)):
            loc = locate(self._extents, o, row)
            if loc is None:
                continue  # a row across two files: never copied, the key fails
            by_ext.setdefault(loc[0], []).append(idx)
            spot[idx] = loc[1]
        for ei, idxs in by_ext.items():
            region = self._region(lane, ei)
            ks, fo = [keys[i] for i in idxs], [spot[i] for i in idxs]
            if job.is_load:
                got = c.get_to_region(lane.ns, ks, region, fo, [row] * len(idxs))
                for i, g in zip(idxs, got):
                    ok[valid[i]] = g == row
            else:
                res = c.put_from_region(lane.ns, ks, region, fo, [row] * len(idxs))
                for i, r in zip(idxs, res):
                    ok[valid[i]] = stored(r)
        return ok


def _file_len(e: Extent) -> int:
    import os
    return os.fstat(e.fd).st_size
