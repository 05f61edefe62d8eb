"""Page copies between one SGLang host pool and the daemon: zero copy into its memfds, or
through the daemon's arena when the pool is not shared memory."""

from __future__ import annotations

import ctypes
from typing import Any, Callable, List, Optional, Sequence

from kvnode.outcomes import committed, stored
from kvnode.pool import Extent, PoolBinding
from kvnode.wire import Connection, KvnodeError, Region


def _by_extent(spots):
    """(extent, object indices) per extent the objects lie in; indices None when all share one."""
    exts = {i for i, _ in spots}
    if len(exts) == 1:
        return [(exts.pop(), None)]
    return [(e, [j for j, (i, _) in enumerate(spots) if i == e]) for e in sorted(exts)]


def get_pages(c: Connection, region: Callable[[Extent], Region], b: PoolBinding, keys: Sequence[str],
              host_indices: Any, hint: dict) -> List[bool]:
    """Reads every page of one pool into its host pages; per page: all its objects hit."""
    pk, ptrs, sizes = b.layout(keys, host_indices)
    spots = b.locate(ptrs, sizes)
    if spots is None:
        flags = copy_in(c, b.ns, pk, ptrs, sizes, hint)
    else:
        flags = [False] * len(pk)
        for ext, idx in _by_extent(spots):
            if idx is None:  # every object in one extent: the lists go as they are
                got = c.get_to_region(b.ns, pk, region(b.extents[ext]),
                                      [o for _, o in spots], sizes, extra=hint)
                flags = [g == n for g, n in zip(got, sizes)]
                break
            got = c.get_to_region(b.ns, [pk[j] for j in idx], region(b.extents[ext]),
                                  [spots[j][1] for j in idx], [sizes[j] for j in idx], extra=hint)
            for j, g in zip(idx, got):
                flags[j] = g == sizes[j]
    return b.pages(flags, len(keys))


def put_pages(c: Connection, region: Callable[[Extent], Region], b: PoolBinding, keys: Sequence[str],
              host_indices: Any) -> List[bool]:
    """Stores every page of one pool from its host pages; per page: all its objects stored."""
    pk, ptrs, sizes = b.layout(keys, host_indices)
    spots = b.locate(ptrs, sizes)
    if spots is None:
        flags = copy_out(c, b.ns, pk, ptrs, sizes)
    else:
        flags = [False] * len(pk)
        for ext, idx in _by_extent(spots):
            if idx is None:
                res = c.put_from_region(b.ns, pk, region(b.extents[ext]),
                                        [o for _, o in spots], sizes)
                flags = [stored(r) for r in res]
                break
            res = c.put_from_region(b.ns, [pk[j] for j in idx], region(b.extents[ext]),
                                    [spots[j][1] for j in idx], [sizes[j] for j in idx])
            for j, r in zip(idx, res):
                flags[j] = stored(r)
    return b.pages(flags, len(keys))


def copy_in(c: Connection, ns: int, pk: list, ptrs: List[int], sizes: List[int],
            hint: Optional[dict] = None) -> List[bool]:
    """Copy path of a get: lease the hits in the daemon's arena, memmove, release."""
    if c.arena is None:
        raise KvnodeError("Unsupported", "this client's tenant has no arena mapping (share_arena = "
                          "false): use shared-memory pools (\"allocator\": \"shm\") or ask for "
                          "share_arena")
    flags: List[bool] = []

    def use(at: int, extents: List[Optional[dict]]) -> None:
        for e, p, s in zip(extents, ptrs[at:], sizes[at:]):
            ok = e is not None and e["len"] == s
            if ok:
                ctypes.memmove(p, c.arena_base + e["offset"], s)
            flags.append(ok)

    # Split where the daemon answers TooLarge (a get larger than it can lease at once).
    c.get_lease_each(ns, pk, use, extra=hint)
    return flags


def copy_out(c: Connection, ns: int, pk: list, ptrs: List[int], sizes: List[int]) -> List[bool]:
    """Copy path of a set: alloc slots in the daemon's arena, memmove, commit."""
    slots = c.alloc(ns, pk, sizes)
    flags, handles = [], []
    for slot, p, s in zip(slots, ptrs, sizes):
        if "Granted" in slot:
            g = slot["Granted"]
            ctypes.memmove(c.arena_base + g["offset"], p, s)
            handles.append(g["handle"])
            flags.append(None)
        else:
            flags.append(stored(slot["Refused"]["status"]))  # refused: only Exists is stored
    done = iter(c.commit(handles))
    return [committed(next(done)) if f is None else f for f in flags]
