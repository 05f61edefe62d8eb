"""One SGLang host pool as kvnode sees it: namespace, per-page objects and shared-memory extents."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from kvnode.namespace import digest_of
from kvnode.wire import key as wire_key

#: Pools whose bytes differ per TP rank even in a rank-replicated (MLA) model.
RANK_SHARDED_POOLS = frozenset({"mamba"})


class UnsupportedPool(ValueError):
    """A host pool kvnode cannot store without risking wrong KV; the message says why."""


@dataclass(frozen=True)
class Extent:
    """A memfd the daemon can attach: `base` is where this process maps its first byte."""

    fd: int
    base: int
    length: int


def _mm_base(mm: Any) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    del anchor
    return addr


def shm_extents(host_pool: Any) -> List[Extent]:
    """The memfds behind an SGLang host pool (`"allocator": "shm"`), or [] when it has none.

    SGLang's ShmHostTensorAllocator keeps one (fd, mmap) per allocation (`fds`, `mms`:
    a Mamba pool allocates its temporal and conv buffers separately); older allocators and
    hand-made pools expose a single `fd` / `mm`.
    """
    alloc = getattr(host_pool, "allocator", None)
    fds = list(getattr(alloc, "fds", None) or [])
    mms = list(getattr(alloc, "mms", None) or [])
    if not fds and getattr(alloc, "fd", None) is not None and getattr(alloc, "mm", None) is not None:
        fds, mms = [alloc.fd], [alloc.mm]
    out = []
    for fd, mm in zip(fds, mms):
        if fd is None or mm is None:
            continue
        out.append(Extent(fd, _mm_base(mm), os.fstat(fd).st_size))
    return out


class PoolBinding:
    """A registered host pool: its kvnode namespace and how its pages map to protocol keys."""

    def __init__(self, name: str, host_pool: Any, ns: int, sizes: Sequence[int],
                 extents: List[Extent], replicated: bool):
        self.name = name
        self.host_pool = host_pool
        self.ns = ns
        self.seg_n = len(sizes)
        self.page_bytes = int(sum(sizes))
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.extents = extents
        self.replicated = replicated

    @property
    def zero_copy(self) -> bool:
        return bool(self.extents)

    def keys(self, keys: Sequence[str]) -> List[list]:
        return [wire_key(digest_of(k), s) for k in keys for s in range(self.seg_n)]

    def layout(self, keys: Sequence[str], host_indices: Any) -> Tuple[List[list], List[int], List[int]]:
        """Protocol keys, host addresses and byte sizes of every object of every page."""
        if host_indices is None or len(host_indices) != len(keys) * self.page_size:
            got = None if host_indices is None else len(host_indices)
            raise ValueError(f"pool {self.name}: {len(keys)} keys need {len(keys) * self.page_size} "
                             f"host indices, got {got}")
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.seg_n:
            raise ValueError(f"pool {self.name}: {len(keys)} keys but {len(ptrs)} page objects "
                             f"(expected {self.seg_n} per page)")
        return self.keys(keys), [int(p) for p in ptrs], [int(s) for s in sizes]

    def locate(self, ptrs: Sequence[int], sizes: Sequence[int]) -> Optional[List[Tuple[int, int]]]:
        """(extent index, offset) of every object, or None if one lies outside every extent."""
        out = []
        for p, s in zip(ptrs, sizes):
            for i, e in enumerate(self.extents):
                if e.base <= p and p + s <= e.base + e.length:
                    out.append((i, p - e.base))
                    break
            else:
                return None
        return out

    def pages(self, flags: Sequence[bool], n: int) -> List[bool]:
        """Object flags folded per page: a page counts only when all its objects do."""
        s = self.seg_n
        return [all(flags[i * s:(i + 1) * s]) for i in range(n)]


def probe_layout(name: str, host_pool: Any) -> List[int]:
    """Object sizes of one page, asked from the pool itself; raises UnsupportedPool with SGLang's reason."""
    import torch  # present whenever SGLang hands us a host pool

    ps = int(getattr(host_pool, "page_size", 1) or 1)
    if not hasattr(host_pool, "get_page_buffer_meta"):
        raise UnsupportedPool(f"host pool {name!r} ({type(host_pool).__name__}) has no "
                              "get_page_buffer_meta: kvnode stores page objects only")
    try:
        ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(ps, dtype=torch.int64))
    except (NotImplementedError, ValueError, AssertionError) as e:
        raise UnsupportedPool(f"host pool {name!r} ({type(host_pool).__name__}, layout "
                              f"{getattr(host_pool, 'layout', '?')!r}) has no zero-copy page "
                              f"layout: {e}") from e
    if not sizes or len(ptrs) != len(sizes) or any(int(s) <= 0 for s in sizes):
        raise UnsupportedPool(f"host pool {name!r} describes a page as {len(ptrs)} objects of "
                              f"sizes {list(sizes)}")
    return [int(s) for s in sizes]
