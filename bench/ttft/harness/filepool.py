"""Test seam for harness/movers.py FileDmaMover: a KV pool whose tensor lives in a shared file.

The fake GPU of a test-seams daemon (KVNODE_TEST_FAKE_GPU) treats an IPC handle as a file
path and copies to and from that file with pread/pwrite; a MAP_SHARED mapping of the same file
(torch.from_file(shared=True)) sees those writes, and the daemon's reads see the pool's.
"""

from __future__ import annotations

import os
import tempfile
import weakref

import torch

from .pool import KvPool


def file_backed(pool: KvPool) -> str:
    """Moves `pool.t` (a CPU tensor) into a shared file mapping once; returns the file's path."""
    path = getattr(pool, "_file_path", None)
    if path is not None:
        return path
    if pool.t.device.type != "cpu":
        raise ValueError("a file-backed pool is for CPU tests (the fake GPU); this pool is on " + str(pool.t.device))
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="kvpool-", dir=root)
    if len(path.encode()) >= 64:
        os.close(fd)
        os.unlink(path)
        raise ValueError(f"{path} is too long for a 64-byte fake IPC handle")
    nbytes = pool.t.numel() * pool.t.element_size()
    os.ftruncate(fd, nbytes)
    os.close(fd)
    t = torch.from_file(path, shared=True, size=pool.t.numel(), dtype=pool.t.dtype).view(pool.t.shape)
    t.copy_(pool.t)
    pool.t = t
    pool._file_path = path
    weakref.finalize(pool, os.unlink, path)
    return path
