"""Layer-wise onload end to end on CPU: a real daemon on the fake GPU, the client, the harness and
the vLLM connector's worker side.

The daemon must be a test-seams build (`cargo build --release --workspace`, as CI builds it)
started with KVNODE_TEST_FAKE_GPU=<fence delay in µs>: an "IPC handle" is then a file path, the
daemon's copies read and write that file, and the KV pool here is a shared mapping of it
(harness/filepool.py). Each fence waits the delay, so layers land one after another.
"""

import os
import time

import pytest
import torch

from harness import model as m
from harness import pool as pl
from harness.daemons import Daemon
from harness import filepool
from harness.lane import Lane
from harness.tier import DaemonTier, TierSpec
from harness.workload import Request
from kvnode import gpu
from kvnode.wire import Connection, KvnodeError


@pytest.fixture
def fake_gpu(kvnode_bin, tmp_path, monkeypatch):
    def start(fence_delay_s: float) -> Daemon:
        monkeypatch.setenv("KVNODE_TEST_FAKE_GPU", str(int(fence_delay_s * 1e6)))
        d = Daemon(f"fg{len(started)}", kvnode_bin, str(tmp_path), dram="64MiB").start()
        started.append(d)
        return d
    started = []
    yield start
    for d in started:
        d.stop()


def _attach(g: gpu.GpuClient, pool: pl.KvPool) -> gpu.AttachedBuffer:
    path = filepool.file_backed(pool)
    try:
        return g.attach(path.encode().ljust(64, b"\0"), 0, pool.t.numel() * pool.t.element_size(), pool.gpu_layout(0))
    except KvnodeError as e:
        if e.code == "Unsupported":
            pytest.fail("KVNODE_BIN has no fake GPU: build it with the test seams "
                        "(cargo build --release --workspace) — " + e.message)
        raise


def the_daemon_lands_layer_0_of_every_page_before_any_layer_1(fake_gpu):
    d = fake_gpu(0.25)
    cfg = m.TINY
    pool = pl.KvPool(cfg, 8, "cpu")
    c = Connection(d.sock)
    g = gpu.GpuClient(c)
    buf = _attach(g, pool)
    ns = c.register({"model": "lw", "page_size": cfg.page_size, "segments": [cfg.page_bytes]})["ns"]
    pool.t.copy_(torch.randn(pool.t.shape).to(pool.t.dtype))
    orig = pool.t.clone()
    keys = [[bytes([i]) * 32, 0] for i in range(4)]
    assert g.offload(ns, keys, [0, 1, 2, 3], buf.buffer) == ["Stored"] * 4
    pool.t.zero_()
    t = g.onload_async(ns, keys, [4, 5, 6, 7], buf.buffer, layers=cfg.layers)
    for layer in range(cfg.layers):
        assert g.onload_layer_wait(t, layer)
        for x in range(cfg.layers):
            got_k, want_k = pool.k(x)[4:8], orig[x, 0, 0:4]
            if x <= layer:
                assert torch.equal(got_k, want_k) and torch.equal(pool.v(x)[4:8], orig[x, 1, 0:4]), (x, layer)
            else:
                assert not pool.k(x)[4:8].any(), f"layer {x} landed before layer {layer}'s wait returned"
    assert g.onload_wait(t) == ["Loaded"] * 4
    assert torch.equal(pool.t[:, :, 4:8], orig[:, :, 0:4]) and not pool.t[:, :, 0:4].any()
    with pytest.raises(KvnodeError) as e:
        g.onload_async(ns, keys, [4, 5, 6, 7], buf.buffer, layers=3)  # 3 does not split a page
    assert e.value.code == "Invalid" and "layers" in e.value.message
    plain = g.onload_async(ns, keys, [4, 5, 6, 7], buf.buffer)
    with pytest.raises(KvnodeError) as e:
        g.onload_layer_wait(plain, 0)
    assert e.value.code == "Invalid" and "not layer-wise" in e.value.message
    assert g.onload_wait(plain) == ["Loaded"] * 4
    c.close()


def _tokens(n, seed):
    return torch.randint(0, m.TINY.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def the_harness_prefill_over_a_layer_wise_onload_matches_kv_computed_in_place(fake_gpu):
    d = fake_gpu(0.02)
    cfg = m.TINY
    dec = m.Decoder(cfg, "cpu", seed=4)
    pre, s1, s2 = _tokens(6 * cfg.page_size, 1), _tokens(10, 2), _tokens(10, 3)
    spec = dict(sock=d.sock, kind="dram", mover="file-dma", ns_name="lw-corr")

    def lane(name, layers=0):
        p = pl.KvPool(cfg, 16, "cpu")
        return Lane(name, dec, p, DaemonTier(TierSpec(layers=layers, **spec), p, client=name))

    x, y = lane("x"), lane("y", layers=cfg.layers)
    x.serve(Request(0, 0, 0, None, pre + s1))
    x.finish()
    t0 = time.perf_counter()
    r = y.serve(Request(1, 0, 1, None, pre + s2), keep_logits=True)
    assert r["layerwise"] and r["tier_hit_tokens"] == len(pre) and r["layerwise_redo_pages"] == 0
    # The prefill waited per layer while the later layers were still being copied.
    assert r["layer_wait_s"] > 0 and time.perf_counter() - t0 >= cfg.layers * 0.02
    ref = Lane("ref", dec, pl.KvPool(cfg, 16, "cpu"))
    ref.serve(Request(0, 0, 0, None, pre + s1))
    r_ref = ref.serve(Request(1, 0, 1, None, pre + s2), keep_logits=True)
    assert torch.equal(r["logits"], r_ref["logits"])
    for dg in y.digests(Request(1, 0, 1, None, pre + s2))[:6]:
        assert torch.equal(y.pool.page(y.cache.table[dg]), x.pool.page(x.cache.table[dg]))
    for ln in (x, y):
        ln.finish()
        ln.tier.close()


def the_vllm_worker_side_waits_per_layer_and_reports_the_step_after_the_forward(fake_gpu):
    from kvnode.vllm.plan import BlockMove, StepPlan
    from kvnode.vllm.worker_side import Placement, WorkerSide
    d = fake_gpu(0.2)
    layers, blocks, page = 3, 6, 1024  # LBNHC-like: layer l of block b at l*blocks*page + b*page
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = os.path.join(root, f"kvv-{os.getpid()}")
    n = layers * blocks * page
    with open(path, "wb") as f:
        f.write(bytes(n))
    try:
        kv = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
        kv.copy_(torch.randint(1, 255, (n,), dtype=torch.uint8))
        orig = kv.clone()
        exported = gpu.ExportedBuffer(path.encode().ljust(64, b"\0"), 0, n, 0)
        ws = WorkerSide(lambda: Connection(d.sock), {"model": "vlw", "page_size": 16, "segments": [layers * page]},
                        layerwise=True, exporter=lambda t: exported)
        ws.register(kv, [Placement(0, blocks * page, page, layers, page, blocks)])
        digests = [bytes([7, i]) * 16 for i in range(2)]
        ws.save([BlockMove("r1", digests, [0, 1])])
        assert ws.drain(timeout_s=30) and ws.stats["save_stored"] == 2
        kv.zero_()
        ws.run_step_loads(StepPlan(loads=[BlockMove("r2", digests, [3, 4])]))

        def layer(buf, l, b):
            at = l * blocks * page + b * page
            return buf[at:at + page]
        for li in range(layers):
            assert ws.wait_step_layer(0, li)
            for x in range(layers):
                for src, dst in ((0, 3), (1, 4)):
                    if x <= li:
                        assert torch.equal(layer(kv, x, dst), layer(orig, x, src)), (x, li)
                    else:
                        assert not layer(kv, x, dst).any(), f"layer {x} landed before layer {li}'s wait"
        assert ws.end_step_loads() == 0 and ws.take_load_errors() == set()
        ws.close()
    finally:
        os.unlink(path)
