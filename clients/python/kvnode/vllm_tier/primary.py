"""vLLM's primary (CPU) tier as the daemon sees it: its rows, and the shared-memory files behind them.

vLLM 0.33 keeps the primary tier in a `SharedOffloadRegion`: a `/dev/shm/vllm_offload_<engine>.mmap`
file (or several, back to back) mapped `MAP_SHARED`, handed to secondary tiers only as a
memoryview of shape (chunks, row bytes). The tier finds the file mappings under the view in
/proc/self/maps, opens each file and checks it is the very inode mapped there; the daemon then
attaches the descriptor (`AttachRegion`) and copies rows straight between its tier and those
pages. Anything else (anonymous memory, a file already unlinked) goes through the arena copy.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class Extent:
    """One file mapping under the primary view: `length` bytes of `fd` from file offset
    `file_off` are mapped at `view_off` bytes into the view."""

    fd: int
    view_off: int
    file_off: int
    length: int
    path: str


def view_base(view: memoryview) -> int:
    """Address of the view's first byte (the anchor is dropped at once: no export is kept)."""
    anchor = ctypes.c_char.from_buffer(view)
    addr = ctypes.addressof(anchor)
    del anchor
    return addr


def _maps() -> List[Tuple[int, int, int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16), int(parts[4]), parts[5].strip()))
    return out


def shared_extents(base: int, length: int) -> Tuple[List[Extent], Optional[str]]:
    """The file extents covering [base, base+length), or ([], why not)."""
    covering = [m for m in _maps() if m[1] > base and m[0] < base + length]
    covering.sort()
    pos, out, fds = base, [], {}
    ok = False
    try:
        for lo, hi, off, inode, path in covering:
            if lo > pos:
                break
            if not path.startswith("/") or path.endswith("(deleted)") or inode == 0:
                return [], f"primary tier memory at {pos:#x} is not a named shared file ({path or 'anonymous'})"
            fd = fds.get((path, inode))
            if fd is None:
                fd = fds[(path, inode)] = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                if os.fstat(fd).st_ino != inode:
                    return [], f"{path} was replaced since vLLM mapped it"
            end = min(hi, base + length)
            out.append(Extent(fd, pos - base, off + (pos - lo), end - pos, path))
            pos = end
            if pos >= base + length:
                break
        if pos < base + length:
            return [], f"primary tier memory at {pos:#x} is not covered by a file mapping"
        ok = True
        return out, None
    finally:
        if not ok:
            for fd in fds.values():
                os.close(fd)


def close_extents(extents: List[Extent]) -> None:
    for fd in {e.fd for e in extents}:
        try:
            os.close(fd)
        except OSError:
            pass


def locate(extents: List[Extent], view_off: int, n: int) -> Optional[Tuple[int, int]]:
    """(extent index, file offset) of [view_off, view_off+n) if it lies inside one extent."""
    for i, e in enumerate(extents):
        if e.view_off <= view_off and view_off + n <= e.view_off + e.length:
            return i, e.file_off + (view_off - e.view_off)
    return None
