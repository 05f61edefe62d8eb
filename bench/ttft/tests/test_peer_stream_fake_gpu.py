"""A pulled prefix streamed into the KV pool on CPU: two real daemons, the destination on the fake
GPU (test-seams build, KVNODE_TEST_FAKE_GPU), the harness tier with `stream_pull`.

The source worker offloads pages; the destination tier looks them up, the router names the
source, and one hinted OnloadAsync pulls the pages and copies each into the pool as it lands.
Checked: every page arrives bitwise, the pull report says Done, and the staged path (Get(Lease)
per chunk, then Onload) gives the same bytes.
"""

import socket

import pytest
import torch

from harness import model as m
from harness import pool as pl
from harness.daemons import Daemon
from harness.tier import DaemonTier, Router, TierSpec


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pair(kvnode_bin, tmp_path, monkeypatch):
    monkeypatch.setenv("KVNODE_TEST_FAKE_GPU", "0")  # both workers' pools are fake-GPU files
    src = Daemon("src", kvnode_bin, str(tmp_path), dram="64MiB", peer_listen=f"127.0.0.1:{_port()}").start()
    dst = Daemon("dst", kvnode_bin, str(tmp_path), dram="64MiB", peer_listen=f"127.0.0.1:{_port()}",
                 peers=[src.endpoint]).start()
    yield src, dst
    dst.stop()
    src.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_a_pulled_prefix_lands_in_the_pool_bitwise(pair, stream):
    src, dst = pair
    cfg, n = m.TINY, 12
    router = Router()
    spool, dpool = pl.KvPool(cfg, n, "cpu"), pl.KvPool(cfg, n, "cpu")
    spool.t.copy_(torch.randn(spool.t.shape).to(spool.t.dtype))
    s = DaemonTier(TierSpec(sock=src.sock, kind="peer", mover="file-dma", ns_name="st",
                            endpoint=src.endpoint), spool, router, client="src")
    d = DaemonTier(TierSpec(sock=dst.sock, kind="peer", mover="file-dma", ns_name="st",
                            endpoint=dst.endpoint, chunk_pages=4, stream_pull=stream), dpool, router,
                   client="dst")
    try:
        digests = [bytes([7, i]) * 16 for i in range(n)]
        s.offload_async(digests, list(range(n)))
        s.drain(wait=True)
        assert all(router.holder.get(x) == src.endpoint for x in digests), router.holder
        free = list(range(n))
        ld, got = d.lookup_and_load(digests, digests, lambda k: [free.pop(0) for _ in range(k)],
                                    lambda p: None)
        assert (ld.pages, ld.pulled, ld.local) == (n, n, 0), ld
        assert ld.pull_report and ld.pull_report["state"] == "Done", ld.pull_report
        if stream:
            assert ld.stage_s == 0.0, "a streamed onload has no separate staging step"
        for i, p in enumerate(got):
            assert torch.equal(dpool.t[:, :, p], spool.t[:, :, i]), f"page {p} (digest {i})"
    finally:
        s.close()
        d.close()
