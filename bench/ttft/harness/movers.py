"""How page blocks move between a worker's KV pool and its daemon.

`DmaMover` is the production path: the pool is exported with CUDA IPC once and the daemon
copies pages by DMA (AttachGpu / Onload / Offload). `CopyMover` moves the same block bytes
through Put / inline Get over the socket; it exists so the harness runs end to end on a
machine without CUDA (CPU CI), where the daemon answers GPU ops with "no CUDA driver".
Both return the daemon's per-key statuses (`Loaded`/`Miss`, `Stored`/`Exists`/...).
"""

from __future__ import annotations

from typing import List, Sequence

from kvnode.gpu import GpuClient, export_tensor
from kvnode.wire import Connection

from .pool import KvPool


class _CountedExport:
    """`pool.t` as kvnode.gpu.export_tensor sees it, keeping the IPC ref counter of torch's
    `_share_cuda_()` (elements 4 and 5 of its tuple) in `pool.ipc_counters`, so the pool can
    be freed after the daemon let go (KvPool.release)."""

    def __init__(self, pool: KvPool):
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool.t, name)

    def untyped_storage(self):
        return _CountedStorage(self._pool)


class _CountedStorage:
    def __init__(self, pool: KvPool):
        self._pool = pool

    def _share_cuda_(self):
        shared = self._pool.t.untyped_storage()._share_cuda_()
        self._pool.ipc_counters.append((shared[4], int(shared[5])))
        return shared


class DmaMover:
    """Daemon-driven CUDA DMA into/out of an exported pool (one attach per connection)."""

    kind = "dma"

    def __init__(self, conn: Connection, pool: KvPool, device: int = 0):
        self.gpu = GpuClient(conn)
        exp = export_tensor(_CountedExport(pool))
        self.attached = self.gpu.attach(exp.handle, device, exp.length, pool.gpu_layout(exp.base))
        if self.attached.page_bytes != pool.cfg.page_bytes:
            raise RuntimeError(f"daemon sees {self.attached.page_bytes} B pages, pool has {pool.cfg.page_bytes}")

    def onload(self, ns: int, keys: Sequence[list], pages: Sequence[int]) -> List[str]:
        return self.gpu.onload(ns, keys, pages, self.attached.buffer)

    def onload_async(self, ns: int, keys: Sequence[list], pages: Sequence[int], layers: int = 0) -> int:
        return self.gpu.onload_async(ns, keys, pages, self.attached.buffer, layers)

    def onload_layer_wait(self, ticket: int, layer: int) -> bool:
        return self.gpu.onload_layer_wait(ticket, layer)

    def onload_pulled_async(self, ns: int, keys: Sequence[list], pages: Sequence[int], hint: str,
                            deadline_ms: int) -> int:
        return self.gpu.onload_pulled_async(ns, keys, pages, hint, self.attached.buffer, deadline_ms)

    def onload_pulled_wait(self, ticket: int):
        return self.gpu.onload_pulled_wait(ticket)

    def onload_wait(self, ticket: int) -> List[str]:
        return self.gpu.onload_wait(ticket)

    def offload(self, ns: int, keys: Sequence[list], pages: Sequence[int]) -> List[str]:
        return self.gpu.offload(ns, keys, pages, self.attached.buffer)


class CopyMover:
    """Block bytes through the socket (Put / inline Get): the no-CUDA stand-in for DmaMover."""

    kind = "copy"

    def __init__(self, conn: Connection, pool: KvPool):
        self.conn, self.pool = conn, pool
        self._pending = {}

    def onload(self, ns: int, keys: Sequence[list], pages: Sequence[int]) -> List[str]:
        blocks = self.conn.get(ns, list(keys))
        out = []
        for b, p in zip(blocks, pages):
            if b is None:
                out.append("Miss")
            elif len(b) != self.pool.cfg.page_bytes:
                out.append("SizeMismatch")
            else:
                self.pool.write_block(p, b)
                out.append("Loaded")
        return out

    def onload_async(self, ns: int, keys: Sequence[list], pages: Sequence[int], layers: int = 0) -> int:
        # No DMA here: the copy is synchronous, so every layer has landed once this returns.
        t = len(self._pending) + 1
        self._pending[t] = self.onload(ns, keys, pages)
        return t

    def onload_layer_wait(self, ticket: int, layer: int) -> bool:
        return ticket in self._pending

    def onload_wait(self, ticket: int) -> List[str]:
        return self._pending.pop(ticket)

    def offload(self, ns: int, keys: Sequence[list], pages: Sequence[int]) -> List[str]:
        return self.conn.put(ns, list(keys), [self.pool.read_block(p) for p in pages])


class FileDmaMover(DmaMover):
    """Test seam: the daemon's DMA path on a machine without CUDA, against a daemon built with
    the test seams and started with KVNODE_TEST_FAKE_GPU (engine/gpu/src/fake.rs). The pool's
    tensor is moved into a shared file mapping and the "IPC handle" is that file's path: the
    daemon's copies read and write the file, so this process's pool sees them."""

    kind = "file-dma"

    def __init__(self, conn: Connection, pool: KvPool):
        from .filepool import file_backed
        path = file_backed(pool)
        self.gpu = GpuClient(conn)
        handle = path.encode().ljust(64, b"\0")
        self.attached = self.gpu.attach(handle, 0, pool.t.numel() * pool.t.element_size(), pool.gpu_layout(0))
        if self.attached.page_bytes != pool.cfg.page_bytes:
            raise RuntimeError(f"daemon sees {self.attached.page_bytes} B pages, pool has {pool.cfg.page_bytes}")


def make_mover(kind: str, conn: Connection, pool: KvPool):
    if kind == "dma":
        return DmaMover(conn, pool, pool.t.device.index or 0)
    if kind == "copy":
        return CopyMover(conn, pool)
    if kind == "file-dma":
        return FileDmaMover(conn, pool)
    raise ValueError(f"unknown mover {kind!r}: use dma (CUDA), copy (no CUDA) or file-dma (tests, fake GPU)")
