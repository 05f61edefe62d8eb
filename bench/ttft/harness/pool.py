"""The paged KV pool of one worker and its GPU prefix cache (page digest -> page id, LRU).

Two engine layouts, both exported to the daemon as one CUDA allocation:
  layer_first  [layer][K|V][page][token][kv_head][dim]   (vLLM / SGLang device pools): a page is
               2*layers objects of page_size*kv_heads*dim*2 bytes (128 KiB for Qwen3-8B)
  page_first   [page][layer][K|V][token][kv_head][dim]: a page is one contiguous object (9 MiB)
A page's block (what the daemon stores) is its objects in (layer, K|V) order in both layouts,
so both give the same bytes for the same KV; they differ only in how many copies a move takes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch

from .model import ModelConfig

LAYOUTS = ("layer_first", "page_first")


class PoolFull(RuntimeError):
    """Every page is pinned by running requests or in-flight offloads."""


class KvPool:
    def __init__(self, cfg: ModelConfig, pages: int, device: str, layout: str = "layer_first",
                 dtype: torch.dtype = torch.bfloat16):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; use one of {LAYOUTS}")
        if pages < 1:
            raise ValueError("a KV pool needs at least one page")
        self.cfg, self.pages, self.layout = cfg, pages, layout
        per = (cfg.page_size, cfg.kv_heads, cfg.head_dim)
        shape = (cfg.layers, 2, pages) + per if layout == "layer_first" else (pages, cfg.layers, 2) + per
        self.t = torch.zeros(shape, dtype=dtype, device=device)
        # torch's CUDA IPC ref counters of this pool's exports (harness/movers.py DmaMover), one
        # (handle, offset) per export; see release().
        self.ipc_counters: List[Tuple[bytes, int]] = []
        self.released = False

    def release(self) -> None:
        """Frees the pool's memory once no daemon maps it any more (its connections closed).

        torch's `_share_cuda_()` (kvnode.gpu.export_tensor) puts the storage behind an IPC ref
        counter set to 1 for the consumer, which a torch consumer decrements when it lets go.
        The daemon is no torch process and never does, so without this the freed tensor waits
        in torch's IPC "limbo" for ever and stays allocated on the GPU: every exported pool of
        a run piled up (74 GiB of an H100 after 13 long-prefix lanes, issue 41's OOM). Here
        each export's counter is dropped the way a torch consumer would, then the tensor; the
        caller runs `torch.cuda.ipc_collect()` / `empty_cache()` (Worker.close)."""
        if self.released:
            return
        for handle, offset in self.ipc_counters:
            torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)
        self.ipc_counters = []
        self.t = None  # any later use fails loudly
        self.released = True

    def k(self, layer: int) -> torch.Tensor:
        """[pages, page_size, kv_heads, dim] view of one layer's K."""
        return self.t[layer, 0] if self.layout == "layer_first" else self.t[:, layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.t[layer, 1] if self.layout == "layer_first" else self.t[:, layer, 1]

    def page(self, p: int) -> torch.Tensor:
        """[layers, 2, page_size, kv_heads, dim] of page p (a copy for layer_first)."""
        return self.t[:, :, p] if self.layout == "layer_first" else self.t[p]

    def read_block(self, p: int) -> bytes:
        """Page p's block bytes, in the daemon's object order."""
        return self.page(p).contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def write_block(self, p: int, data: bytes) -> None:
        src = torch.frombuffer(bytearray(data), dtype=self.t.dtype).view(self.page(p).shape)
        if self.layout == "layer_first":
            self.t[:, :, p] = src.to(self.t.device)
        else:
            self.t[p] = src.to(self.t.device)

    @property
    def chunk_bytes(self) -> int:
        c = self.cfg
        return c.page_size * c.kv_heads * c.head_dim * 2

    def gpu_layout(self, base: int):
        """The daemon's view of this pool (kvnode.gpu.GpuLayout), page 0 at byte `base`."""
        from kvnode.gpu import GpuLayout
        if self.layout == "page_first":
            return GpuLayout.page_first(base, self.pages, self.cfg.page_bytes)
        return GpuLayout.layer_first(base, self.pages, self.chunk_bytes, 2 * self.cfg.layers)


class PrefixCache:
    """GPU prefix cache over page digests: leading-run match, LRU eviction of unpinned pages.

    A page is pinned while a request uses it and while an offload reads it. Evicting a page in
    the middle of a chain makes the pages after it unreachable until they are evicted too
    (they are older in LRU order than anything a later match touches).
    """

    def __init__(self, pages: int):
        self.capacity = pages
        # Popped from the end: a fresh cache hands out ascending page ids, so a run of pages
        # is consecutive on the device (a layer-wise onload fuses such runs into one copy).
        self.free: List[int] = list(range(pages - 1, -1, -1))
        self.table: "OrderedDict[bytes, int]" = OrderedDict()
        self.owner: Dict[int, bytes] = {}
        self.pins: Dict[int, int] = {}
        self.evictions = 0

    def match(self, digests: Sequence[bytes]) -> List[int]:
        out = []
        for d in digests:
            p = self.table.get(d)
            if p is None:
                break
            self.table.move_to_end(d)
            out.append(p)
        return out

    def pin(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.pins[p] = self.pins.get(p, 0) + 1

    def unpin(self, pages: Sequence[int]) -> None:
        for p in pages:
            n = self.pins[p] - 1
            if n:
                self.pins[p] = n
            else:
                del self.pins[p]

    def alloc(self, n: int) -> List[int]:
        """n free pages, evicting least recently used unpinned cached pages; pinned on return."""
        out = []
        while len(out) < n and self.free:
            out.append(self.free.pop())
        if len(out) < n:
            for d in list(self.table):
                p = self.table[d]
                if p in self.pins:
                    continue
                del self.table[d]
                del self.owner[p]
                self.evictions += 1
                out.append(p)
                if len(out) == n:
                    break
        if len(out) < n:
            self.free.extend(out)
            raise PoolFull(f"need {n} pages, {len(out)} evictable of {self.capacity}")
        self.pin(out)
        return out

    def insert(self, digest: bytes, page: int) -> None:
        """Publishes a full page. A digest already cached keeps its page (the caller frees `page`)."""
        if digest in self.table:
            raise ValueError("digest already cached")
        self.table[digest] = page
        self.owner[page] = digest

    def release(self, pages: Sequence[int]) -> None:
        """Returns unpublished pages (partial tails) to the free list; unpins them."""
        self.unpin(pages)
        for p in pages:
            if p not in self.owner and p not in self.pins:
                self.free.append(p)

    def clear(self) -> None:
        if self.pins:
            raise RuntimeError("cannot clear a prefix cache with pinned pages")
        self.__init__(self.capacity)
