"""The daemon's GPU ops from Python: attach a CUDA IPC-exported KV buffer, move pages (docs/gpu.md).

The daemon copies between an engine's GPU memory and its pinned DRAM arena by DMA on its own
CUDA streams; Python only names pages. Pages are addressed by *page id* inside one exported
buffer, whose layout says where each page's bytes are:

    object j of page p = allocation bytes [base + p*page_stride + objects[j].offset, + objects[j].size)
    block of page p    = object 0 || object 1 || ...          page_bytes = sum(objects[j].size)

Typical use (torch is imported only by `export_tensor`)::

    conn = Connection(sock)                       # kvnode.wire.Connection
    gpu = GpuClient(conn)
    gpu.wait_registered()                         # optional: copies run pinned once registered
    exp = export_tensor(kv_pool)                  # kv_pool: [pages, ...] bf16 on cuda
    layout = GpuLayout.page_first(exp.base, pages, page_bytes)
    buf = gpu.attach(exp.handle, exp.device, exp.length, layout)
    ns = conn.register({..., "segments": [buf.page_bytes]})["ns"]
    gpu.offload(ns, keys, page_ids)               # -> ["Stored" | "Exists" | "NoSpace" | ...]
    gpu.onload(ns, keys, page_ids)                # -> ["Loaded" | "Miss" | "SizeMismatch" | ...]
    t = gpu.onload_async(ns, keys, page_ids); ...; gpu.onload_wait(t)   # or onload_cancel(t)

Contract (the daemon's, docs/gpu.md): `offload` replies after every copy completed and the
blocks are committed; `onload` after every copy completed; after `onload_wait`/`onload_cancel`
returns the daemon never writes those pages again (`Cancelled` pages were not written at all).
A buffer stays mapped until the connection closes; page moves name it by `buffer` (default 0,
the first attached). A `GpuClient` is as thread-safe as its `Connection`: not at all (use one
connection per thread; each connection attaches the buffers it moves).

API (stable: other code imports it):
    GpuObject(offset, size), GpuLayout(base, page_stride, pages, objects)
        .page_bytes, .validate(length), .to_wire(), GpuLayout.page_first(...), GpuLayout.layer_first(...)
    ExportedBuffer(handle, device, length, base); export_tensor(tensor) -> ExportedBuffer
    AttachedBuffer(buffer, page_bytes)
    GpuClient(conn): attach, offload, onload, onload_async, onload_wait, onload_cancel,
        gpu_stats, wait_registered
    leading(results, ok="Loaded") -> int
    LayoutError (ValueError), GPU_ALIGN, IPC_HANDLE_LEN, MAX_OBJECTS
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvnode.wire import Connection, KvnodeError

#: Bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t).
IPC_HANDLE_LEN = 64
#: Alignment the daemon requires of base, page_stride and every object offset and size.
GPU_ALIGN = 16
#: Most objects (gathered extents) per page.
MAX_OBJECTS = 4096


class LayoutError(ValueError):
    """A layout, handle or page list the daemon would refuse, caught before sending."""


@dataclass(frozen=True)
class GpuObject:
    """One contiguous part of a page: `size` bytes at `offset` from the page's start."""

    offset: int
    size: int


@dataclass(frozen=True)
class GpuLayout:
    """Where the pages of an exported buffer are (mirrors kvnode_proto::gpu::GpuLayout)."""

    base: int
    page_stride: int
    pages: int
    objects: Tuple[GpuObject, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's block (the DRAM slot size to register)."""
        return sum(o.size for o in self.objects)

    @classmethod
    def page_first(cls, base: int, pages: int, page_bytes: int) -> "GpuLayout":
        """A buffer `[page][...]`: one object of `page_bytes` per page."""
        return cls(base, page_bytes, pages, (GpuObject(0, page_bytes),))

    @classmethod
    def layer_first(cls, base: int, pages: int, chunk_bytes: int, slices: int) -> "GpuLayout":
        """A buffer `[slice][page][chunk]` (e.g. slice = (layer, K|V)): `slices` objects per page.

        Page p's block is slice 0's chunk of p, then slice 1's, ... (object j at offset
        j * pages * chunk_bytes, page_stride = chunk_bytes).
        """
        objs = tuple(GpuObject(j * pages * chunk_bytes, chunk_bytes) for j in range(slices))
        return cls(base, chunk_bytes, pages, objs)

    def validate(self, length: int) -> None:
        """Raises LayoutError where the daemon's GpuLayout::validate would refuse."""
        if self.pages < 1 or not self.objects:
            raise LayoutError("layout has no pages or no objects")
        if len(self.objects) > MAX_OBJECTS:
            raise LayoutError(f"layout has {len(self.objects)} objects per page; at most {MAX_OBJECTS}")
        checks = [("base", self.base), ("page_stride", self.page_stride)]
        for j, o in enumerate(self.objects):
            if o.size <= 0:
                raise LayoutError(f"object {j} has size {o.size}")
            checks += [("object offset", o.offset), ("object size", o.size)]
        for what, v in checks:
            if v < 0 or v % GPU_ALIGN:
                raise LayoutError(f"{what} = {v} is not a non-negative multiple of {GPU_ALIGN} bytes")
        last = self.pages - 1
        for j, o in enumerate(self.objects):
            end = self.base + last * self.page_stride + o.offset + o.size
            if end > length:
                raise LayoutError(
                    f"page {last} object {j} ends at byte {end}, past the buffer's {length} bytes")

    def to_wire(self) -> Dict[str, Any]:
        return {"base": self.base, "page_stride": self.page_stride, "pages": self.pages,
                "objects": [{"offset": o.offset, "size": o.size} for o in self.objects]}


@dataclass(frozen=True)
class ExportedBuffer:
    """A CUDA allocation exported for the daemon.

    `handle`: the raw 64-byte cudaIpcMemHandle_t; `device`: CUDA ordinal (same
    CUDA_VISIBLE_DEVICES as the daemon); `length`: bytes of the allocation from its start
    that the client vouches for; `base`: byte offset of the tensor inside the allocation
    (use it as GpuLayout.base, plus any offset of page 0 inside the tensor).
    """

    handle: bytes
    device: int
    length: int
    base: int


def export_tensor(tensor: Any) -> ExportedBuffer:
    """Exports a contiguous CUDA tensor's allocation with torch's CUDA IPC.

    torch's `_share_cuda_()` returns a 66-byte handle (version byte, kind byte, then the
    64-byte cudaIpcMemHandle_t); kind 'c' is a plain cudaMalloc segment. Expandable segments
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be exported as one handle.
    """
    if not getattr(tensor, "is_cuda", False):
        raise LayoutError("export_tensor needs a CUDA tensor")
    if not tensor.is_contiguous():
        raise LayoutError("export_tensor needs a contiguous tensor (its pages are addressed by byte offsets)")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    device, handle, storage_size, storage_offset = shared[0], shared[1], shared[2], shared[3]
    if len(handle) == IPC_HANDLE_LEN + 2:
        if chr(handle[1]) != "c":
            raise LayoutError(
                f"torch exported an IPC handle of kind {chr(handle[1])!r}, not a plain cudaMalloc "
                "segment ('c'): turn off expandable_segments in PYTORCH_CUDA_ALLOC_CONF")
        handle = handle[2:]
    if len(handle) != IPC_HANDLE_LEN:
        raise LayoutError(f"unexpected IPC handle length {len(handle)} from torch")
    base = storage_offset + tensor.storage_offset() * tensor.element_size()
    return ExportedBuffer(bytes(handle), int(device), int(storage_offset + storage_size), int(base))


@dataclass(frozen=True)
class AttachedBuffer:
    """The daemon's answer to AttachGpu: buffer id for page moves, bytes per page block."""

    buffer: int
    page_bytes: int


def leading(results: Sequence[str], ok: str = "Loaded") -> int:
    """Length of the leading run of `ok` results (the usable prefix of a page move)."""
    n = 0
    for r in results:
        if r != ok:
            break
        n += 1
    return n


def _check_move(keys: Sequence[list], page_ids: Sequence[int]) -> None:
    if len(keys) != len(page_ids):
        raise LayoutError(f"{len(keys)} keys but {len(page_ids)} page ids")
    for p in page_ids:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise LayoutError(f"page id {p!r} is not a non-negative integer")


class GpuClient:
    """GPU ops over one kvnode.wire.Connection (blocking; not thread-safe)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def attach(self, handle: bytes, device: int, length: int, layout: GpuLayout) -> AttachedBuffer:
        """AttachGpu: the daemon opens the IPC handle on `device` for this connection's lifetime."""
        if len(handle) != IPC_HANDLE_LEN:
            raise LayoutError(f"CUDA IPC handle must be {IPC_HANDLE_LEN} bytes, got {len(handle)}")
        if not any(handle):
            raise LayoutError("CUDA IPC handle is all zeroes")
        layout.validate(length)
        body = self.conn.call({"AttachGpu": {"handle": bytes(handle), "device": int(device),
                                             "len": int(length), "layout": layout.to_wire()}})[1]
        return AttachedBuffer(body["buffer"], body["page_bytes"])

    def _move(self, op: str, ns: int, keys: Sequence[list], page_ids: Sequence[int], buffer: int,
              layers: int = 0, hint: Optional[str] = None, deadline_ms: Optional[int] = None):
        _check_move(keys, page_ids)
        body = {"ns": ns, "keys": list(keys), "page_ids": [int(p) for p in page_ids], "buffer": buffer}
        if layers:
            if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
                raise LayoutError(f"layers must be a non-negative integer, got {layers!r}")
            body["layers"] = layers
        if hint is not None:
            body["hint"] = str(hint)
            if deadline_ms is not None:
                body["deadline_ms"] = int(deadline_ms)
        return self.conn.call({op: body})

    def onload_pulled_async(self, ns: int, keys: Sequence[list], page_ids: Sequence[int], hint: str,
                            buffer: int = 0, deadline_ms: Optional[int] = None) -> int:
        """Starts an onload whose keys this node lacks are pulled from the peer `hint` names (the
        JSON of a hinted Get); the daemon copies each page into the GPU as soon as its block has
        landed verified, while later blocks are still on the wire. Finish it with
        onload_pulled_wait (statuses and the pull's report) or onload_cancel."""
        return self._move("OnloadAsync", ns, keys, page_ids, buffer, 0, hint, deadline_ms)[1]["ticket"]

    def onload_pulled_wait(self, ticket: int) -> Tuple[List[str], Optional[Dict[str, Any]]]:
        """Waits for an onload: (one OnloadStatus per key, the pull's report or None)."""
        body = self.conn.call({"OnloadWait": {"ticket": int(ticket)}})[1]
        return body["results"], body.get("pull")

    def offload(self, ns: int, keys: Sequence[list], page_ids: Sequence[int], buffer: int = 0) -> List[str]:
        """Copies GPU pages into new DRAM blocks; one PutStatus per key (`Stored`, `Exists`, ...)."""
        return self._move("Offload", ns, keys, page_ids, buffer)[1]["results"]

    def onload(self, ns: int, keys: Sequence[list], page_ids: Sequence[int], buffer: int = 0) -> List[str]:
        """Copies DRAM blocks into GPU pages; one OnloadStatus per key (`Loaded`, `Miss`, ...)."""
        return self._move("Onload", ns, keys, page_ids, buffer)[1]["results"]

    def onload_split(self, ns: int, keys: Sequence[list], page_ids: Sequence[int], buffer: int = 0
                     ) -> List[str]:
        """`onload` of any length: split where the daemon answers TooLarge (pages it cannot
        lease at once), each part finished before the next is asked for."""
        out: List[str] = []
        at = 0
        while at < len(keys):
            want = len(keys) - at
            while True:
                try:
                    out += self.onload(ns, keys[at:at + want], page_ids[at:at + want], buffer)
                    break
                except KvnodeError as e:
                    if e.code != "TooLarge" or not e.leasable or e.leasable >= want:
                        raise
                    want = e.leasable
            at += want
        return out

    def onload_async(self, ns: int, keys: Sequence[list], page_ids: Sequence[int], buffer: int = 0,
                     layers: int = 0) -> int:
        """Starts an onload; returns its ticket for onload_wait / onload_cancel.

        `layers` > 0: layer-wise. Each block is `layers` equal runs in model order; the daemon
        copies layer 0 of every page, then layer 1, ..., and `onload_layer_wait(ticket, l)`
        returns once layer l has landed, so the forward pass can start on layer 0.
        """
        return self._move("OnloadAsync", ns, keys, page_ids, buffer, layers)[1]["ticket"]

    def onload_layer_wait(self, ticket: int, layer: int) -> bool:
        """Waits until `layer` of a layer-wise onload is in every page. False: the onload
        stopped first (a copy failed); onload_wait then says which pages are whole."""
        return bool(self.conn.call({"OnloadLayerWait": {"ticket": int(ticket), "layer": int(layer)}})[1]["complete"])

    def onload_wait(self, ticket: int) -> List[str]:
        """Waits for an async onload; one OnloadStatus per key."""
        return self.conn.call({"OnloadWait": {"ticket": int(ticket)}})[1]["results"]

    def onload_cancel(self, ticket: int) -> List[str]:
        """Stops issuing copies and waits for those issued; `Cancelled` pages were not written."""
        return self.conn.call({"OnloadCancel": {"ticket": int(ticket)}})[1]["results"]

    def gpu_stats(self) -> Dict[str, Any]:
        """The `gpu` section of Stats: driver, registered_bytes, attached, offload/onload bytes."""
        return self.conn.stats()["gpu"]

    def wait_registered(self, timeout_s: float = 120.0) -> Dict[str, Any]:
        """Waits until the daemon's arena is registered with CUDA (pinned copies); returns stats.

        Raises KvnodeError("Unsupported") at once when the daemon has no CUDA driver, and
        TimeoutError when registration does not finish in `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.conn.stats()
            gpu = st["gpu"]
            if gpu["driver"].startswith("no CUDA driver"):
                raise KvnodeError("Unsupported", gpu["driver"])
            cap = sum(t.get("capacity_bytes", 0) for t in st["tiers"][:1])
            if gpu["driver"].startswith("ready") and gpu["registered_bytes"] >= cap:
                return gpu
            if time.monotonic() > deadline:
                raise TimeoutError(f"arena not registered with CUDA after {timeout_s}s: {gpu}")
            time.sleep(0.05)
