"""The worker half of the kvnode vLLM connector: daemon DMA between vLLM's KV blocks and the
DRAM tier. Needs torch (CUDA) but not vllm, so it runs and is tested on a GPU box without vllm.

vLLM 0.33 allocates every KV cache tensor in ONE backing allocation: layer l of block b of a
KVCacheTensor lives at `offset + l*layer_stride + b*block_stride`, `page_bytes` long (K and V
together). The worker exports that allocation once (CUDA IPC) and attaches it to the daemon
once per KVCacheTensor (AttachGpu), each as a layout whose page p is block p of every layer:

    objects = [(l * layer_stride, page_bytes) for l in layers]     page_stride = block_stride

(one object of layers*page_bytes when the layers of a block are adjacent, the block-outermost
layouts). kvnode segment i of a block is KVCacheTensor i's bytes of that block.

Loads (`start_load`) run before the forward: the current CUDA stream is synchronized first (vLLM
zeroes new blocks on it, and freed blocks may still be read by the last step's kernels), then one
`OnloadAsync` per segment, then `OnloadWait` for each: the daemon answers only after its copies
completed, so the forward can read the blocks. Any block not `Loaded` (a miss, an evicted block,
a size mismatch, a cancelled copy) is a load error: vLLM recomputes it (never serves it).

Layer-wise (`layerwise=True`): each segment's `OnloadAsync` carries `layers` = the segment's
layers, so the daemon copies layer 0 of every block first; `start_load` returns once the copies
are issued, `wait_layer(seg, i)` (the connector's wait_for_layer_load) blocks until that layer
landed (`OnloadLayerWait`), and `finish_load` after the forward collects the per-block statuses
(a block not `Loaded` is a load error as above: vLLM discards the step's output for its
requests and recomputes them).

Saves (`save`) run after the forward on a background thread with its own connection: it waits
for a CUDA event recorded after the forward, then `Offload`s per segment (the daemon commits
after its copies completed). A request's blocks stay allocated until all its offloads ended
(`finished`), and preemption waits for the offloads of preempted requests (`drain`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from kvnode.gpu import GpuClient, GpuLayout, GpuObject, export_tensor
from kvnode.vllm.plan import BlockMove, StepPlan
from kvnode.wire import Connection, KvnodeError

logger = logging.getLogger("kvnode.vllm")


@dataclass(frozen=True)
class Placement:
    """One vLLM KVCacheTensor: `layers` layer pages of `page_bytes` per block, layer l of block
    b at byte `offset + l*layer_stride + b*block_stride` of the backing allocation."""

    offset: int
    layer_stride: int
    block_stride: int
    layers: int
    page_bytes: int
    num_blocks: int

    def layout(self, alloc_base: int) -> GpuLayout:
        if self.layers > 1 and self.layer_stride == self.page_bytes:
            objects: Tuple[GpuObject, ...] = (GpuObject(0, self.layers * self.page_bytes),)
        else:
            objects = tuple(GpuObject(l * self.layer_stride, self.page_bytes) for l in range(self.layers))
        return GpuLayout(alloc_base + self.offset, self.block_stride, self.num_blocks, objects)


@dataclass
class _Attached:
    conn: Connection
    gpu: GpuClient
    ns: int
    buffers: List[int]


class WorkerSide:
    """Onload/offload of vLLM KV blocks through the daemon for one worker (one GPU)."""

    def __init__(self, connect: Callable[[], Connection], namespace_spec: Dict[str, Any],
                 layerwise: bool = False, exporter: Callable[[Any], Any] = export_tensor):
        self._connect = connect
        self._spec = namespace_spec
        self.layerwise = layerwise
        self._export = exporter  # tests on the fake GPU pass a file-backed "IPC" export
        self._pending: List[Tuple[int, List[int]]] = []  # this step's layer-wise tickets
        self._load: Optional[_Attached] = None
        self._nseg = len(namespace_spec["segments"])
        self._errors: Set[int] = set()
        self._pending_saves: Dict[str, int] = {}
        self._had_saves: Set[str] = set()
        self._finishing: Set[str] = set()
        self._lock = threading.Condition()
        self._save_q: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._save_thread: Optional[threading.Thread] = None
        self._save_error: Optional[BaseException] = None
        self._storage_tensor: Any = None
        self._placements: List[Placement] = []
        # Counters (bytes, blocks, seconds) for stats and metrics.
        self.stats = {"load_blocks": 0, "load_errors": 0, "load_s": 0.0, "save_blocks": 0,
                      "save_stored": 0, "save_s": 0.0, "layer_wait_s": 0.0}

    # -- registration ----------------------------------------------------------------------
    def register(self, any_view: Any, placements: Sequence[Placement]) -> None:
        """Exports the allocation behind `any_view` (any KV view of it) and attaches it, once
        for loads (this thread's connection) and once for saves (the save thread's)."""
        import torch

        if len(placements) != self._nseg:
            raise ValueError(f"{len(placements)} KV cache tensors but the namespace has {self._nseg} segments")
        storage = any_view.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=any_view.device).set_(storage)
        self._storage_tensor = flat
        self._placements = list(placements)
        self._load = self._attach()
        self._save_thread = threading.Thread(target=self._save_loop, name="kvnode-save", daemon=True)
        self._save_thread.start()

    def _attach(self) -> _Attached:
        exp = self._export(self._storage_tensor)
        conn = self._connect()
        gpu = GpuClient(conn)
        ns = conn.register(self._spec)["ns"]
        buffers = []
        for i, p in enumerate(self._placements):
            layout = p.layout(exp.base)
            got = gpu.attach(exp.handle, exp.device, exp.length, layout)
            if got.page_bytes != p.layers * p.page_bytes:
                raise KvnodeError("Invalid", f"segment {i}: daemon sees {got.page_bytes} bytes per block, "
                                             f"expected {p.layers * p.page_bytes}")
            buffers.append(got.buffer)
        return _Attached(conn, gpu, ns, buffers)

    # -- loads -----------------------------------------------------------------------------
    def start_load(self, loads: Sequence[BlockMove]) -> List[Tuple[int, List[int]]]:
        """Issues the onloads of a step; returns the tickets (with the block ids they cover)."""
        if not loads:
            return []
        import torch

        assert self._load is not None, "register_kv_caches was not called"
        if self._storage_tensor.is_cuda:
            torch.cuda.current_stream().synchronize()
        digests = [d for m in loads for d in m.digests]
        ids = [b for m in loads for b in m.block_ids]
        tickets = []
        for seg, buf in enumerate(self._load.buffers):
            keys = [[d, seg] for d in digests]
            layers = self._placements[seg].layers if self.layerwise else 0
            try:
                tickets.append((self._load.gpu.onload_async(self._load.ns, keys, ids, buffer=buf, layers=layers), ids))
            except KvnodeError as e:
                if e.code != "TooLarge" or layers:
                    raise
                # More than the daemon can lease at once: load it in leading parts now.
                tickets.append((self._load.gpu.onload_split(self._load.ns, keys, ids, buffer=buf), ids))
        return tickets

    def wait_layer(self, tickets: Sequence[Tuple[int, List[int]]], seg: int, layer: int) -> bool:
        """Layer-wise: waits until `layer` of segment `seg`'s onload landed. False when that
        onload stopped first (its blocks then come back from finish_load as load errors)."""
        if not tickets:
            return True
        assert self._load is not None
        t0 = time.perf_counter()
        ok = self._load.gpu.onload_layer_wait(tickets[seg][0], layer)
        self.stats["layer_wait_s"] += time.perf_counter() - t0
        return ok

    def finish_load(self, tickets: Sequence[Tuple[int, List[int]]], cancel: bool = False) -> int:
        """Waits for (or cancels) the step's onloads; records failed block ids; returns how
        many blocks failed."""
        if not tickets:
            return 0
        assert self._load is not None
        t0 = time.perf_counter()
        bad: Set[int] = set()
        for ticket, ids in tickets:
            op = self._load.gpu.onload_cancel if cancel else self._load.gpu.onload_wait
            done = ticket if isinstance(ticket, list) else op(ticket)  # a split load is done
            for status, b in zip(done, ids):
                if status != "Loaded":
                    bad.add(b)
        self.stats["load_s"] += time.perf_counter() - t0
        self.stats["load_blocks"] += len(tickets[0][1])
        self.stats["load_errors"] += len(bad)
        with self._lock:
            self._errors |= bad
        if bad:
            logger.warning("kvnode: %d of %d blocks did not load; vLLM recomputes them",
                           len(bad), len(tickets[0][1]))
        return len(bad)

    def load(self, loads: Sequence[BlockMove]) -> int:
        return self.finish_load(self.start_load(loads))

    def take_load_errors(self) -> Set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    # -- saves -----------------------------------------------------------------------------
    def save(self, saves: Sequence[BlockMove]) -> None:
        """Queues the step's offloads behind a CUDA event recorded on the current stream."""
        if not saves:
            return
        import torch

        if self._save_error is not None:
            raise RuntimeError(f"kvnode save thread failed: {self._save_error}")
        # A host-memory cache (CPU tests) has no stream to wait for.
        event = None
        if self._storage_tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        with self._lock:
            for m in saves:
                self._pending_saves[m.req_id] = self._pending_saves.get(m.req_id, 0) + 1
                self._had_saves.add(m.req_id)
        self._save_q.put((event, list(saves)))

    def _save_loop(self) -> None:
        att: Optional[_Attached] = None
        while True:
            item = self._save_q.get()
            if item is None:
                if att is not None:
                    att.conn.close()
                return
            event, saves = item
            try:
                if att is None:
                    att = self._attach()
                if event is not None:
                    event.synchronize()
                t0 = time.perf_counter()
                digests = [d for m in saves for d in m.digests]
                ids = [b for m in saves for b in m.block_ids]
                stored = 0
                for seg, buf in enumerate(att.buffers):
                    res = att.gpu.offload(att.ns, [[d, seg] for d in digests], ids, buffer=buf)
                    stored += sum(1 for r in res if r == "Stored")
                self.stats["save_s"] += time.perf_counter() - t0
                self.stats["save_blocks"] += len(ids)
                self.stats["save_stored"] += stored
            except (KvnodeError, OSError) as e:
                # A failed offload only loses cache entries; the blocks are still released.
                logger.warning("kvnode offload failed: %s", e)
                if att is not None:
                    try:
                        att.conn.close()
                    except OSError:
                        pass
                att = None
            except BaseException as e:  # noqa: BLE001 - surfaced on the next save()
                self._save_error = e
            with self._lock:
                for m in saves:
                    self._pending_saves[m.req_id] -= 1
                    if self._pending_saves[m.req_id] == 0:
                        del self._pending_saves[m.req_id]
                self._lock.notify_all()

    def drain(self, req_ids: Optional[Sequence[str]] = None, timeout_s: float = 60.0) -> bool:
        """Waits until the offloads of `req_ids` (all, if None) ended. True if they did."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                pending = self._pending_saves if req_ids is None else \
                    [r for r in req_ids if r in self._pending_saves]
                if not pending:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)

    def finished(self, finished_req_ids: Set[str]) -> Set[str]:
        """Requests that finished (now or earlier) whose offloads all ended: their blocks may
        be freed. Requests that never offloaded are not reported (vLLM freed them already)."""
        with self._lock:
            self._finishing |= {r for r in finished_req_ids if r in self._had_saves}
            done = {r for r in self._finishing if r not in self._pending_saves}
            self._finishing -= done
            self._had_saves -= done
        return done

    # -- per step --------------------------------------------------------------------------
    def run_step_loads(self, plan: StepPlan) -> None:
        """Before the forward: page-by-page, every onload completes here; layer-wise, the
        onloads are started and `wait_layer` / `end_step_loads` finish them."""
        if plan.preempted:
            self.drain(plan.preempted)
        if self.layerwise:
            self.end_step_loads()  # a step that never reached its end (an exception) cancels
            self._pending = self.start_load(plan.loads)
        else:
            self.load(plan.loads)

    def wait_step_layer(self, seg: int, layer: int) -> bool:
        return self.wait_layer(self._pending, seg, layer)

    def end_step_loads(self, cancel: bool = False) -> int:
        """After the forward (layer-wise): the step's per-block statuses; returns failures."""
        pending, self._pending = self._pending, []
        return self.finish_load(pending, cancel=cancel)

    def close(self) -> None:
        if self._save_thread is not None:
            self.drain(timeout_s=30)
            self._save_q.put(None)
            self._save_thread.join(timeout=10)
        if self._load is not None:
            if self._pending:
                self.end_step_loads(cancel=True)
            self._load.conn.close()
            self._load = None
