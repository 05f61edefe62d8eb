"""Lease gets larger than the DRAM tier can lease at once (issue 27): a real daemon with a
16 MiB DRAM tier over a real spill file under /var/tmp, 200 pages of 256 KiB (50 MiB) so
most of them live on NVMe only. One `get_lease` of them all is refused as `TooLarge` with
the leading count that can be leased; `get_lease_each` splits on it and hands every page
over, in order and byte-exactly, leaving no lease behind. Pure Python (no torch).
Run: `python -m pytest clients/python/tests/test_lease_split.py` (daemon built first).
"""

import ctypes
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import Daemon
from kvnode.wire import Connection, KvnodeError, key

PAGE = 256 << 10
PAGES = 200


def page(i: int) -> bytes:
    return bytes(((i * 7) ^ j) & 0xFF for j in range(256)) * (PAGE // 256)


def digest(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00" * 23 + b"\x3c"


def dram_tier(c: Connection) -> dict:
    return next(t for t in c.stats()["tiers"] if t["tier"] == "dram")


@pytest.fixture
def spilling(tmp_path):
    spill = Path(f"/var/tmp/kvnode-py-lease-split-{os.getpid()}")
    shutil.rmtree(spill, ignore_errors=True)
    spill.mkdir(parents=True)
    d = Daemon(tmp_path, dram="16MiB",
               extra=("--spill-dir", str(spill), "--spill-size", "96MiB"))
    yield d
    d.stop()
    shutil.rmtree(spill, ignore_errors=True)


def test_get_lease_each_splits_a_get_larger_than_dram_and_hands_over_every_page(spilling):
    c = Connection(spilling.socket)
    assert c.arena_base, "the default tenant maps the arena"
    ns = c.register({"model": "lease-split", "page_size": 16, "segments": [PAGE]})["ns"]
    for i in range(PAGES):
        assert c.put(ns, [key(digest(i))], [page(i)]) == ["Stored"], f"page {i}"
    keys = [key(digest(i)) for i in range(PAGES)]
    t0 = time.monotonic()
    while dram_tier(c)["in_flight"] > 0:  # demotions settle before the gets
        assert time.monotonic() - t0 < 20, "demotions never finished"
        time.sleep(0.01)

    with pytest.raises(KvnodeError) as refused:
        c.get_lease(ns, keys)
    assert refused.value.code == "TooLarge"
    assert 0 < refused.value.leasable < PAGES, refused.value.leasable

    parts = []
    seen = {}

    def use(at, extents):
        parts.append((at, len(extents)))
        for j, e in enumerate(extents):
            assert e is not None, f"page {at + j} is held and must be leased"
            seen[at + j] = ctypes.string_at(c.arena_base + e["offset"], e["len"])

    c.get_lease_each(ns, keys, use)
    assert len(parts) > 1, f"a get of 3x the DRAM tier came in one part: {parts}"
    assert [p[0] for p in parts] == [sum(n for _, n in parts[:k]) for k in range(len(parts))]
    assert sorted(seen) == list(range(PAGES))
    for i in range(PAGES):
        assert seen[i] == page(i), f"page {i}"
    dram = dram_tier(c)
    assert (dram["leases"], dram["reserved"]) == (0, 0), dram
    c.close()
