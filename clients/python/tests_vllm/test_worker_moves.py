"""KvnodeConnector's worker-role GPU moves, driven through the methods vLLM's model runner calls
(register_kv_caches, bind_connector_metadata, start_load_kv, wait_for_layer_load, wait_for_save,
get_finished, get_block_ids_with_load_errors), page by page and layer-wise, against a real daemon
on its fake GPU.

The daemon must be a test-seams build (`cargo build --release --workspace`, as CI builds it)
started with KVNODE_TEST_FAKE_GPU: an "IPC handle" is then a file path and the daemon's copies
read and write that file. The KV allocation here is a shared mapping of such a file (what a
cudaMalloc'd tensor is to the real daemon), laid out as vLLM's KVCacheTensor says
(layer-major: layer l of block b at l * layer_stride + b * block_stride). The one seam is the
exporter: the connector's worker side is handed the file's path instead of a CUDA IPC handle.
"""

import contextlib
import os
import time

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from conftest import Daemon, kv_cache_config, one_rank, vllm_config
from kvnode import gpu
from kvnode.vllm import KvnodeConnector
from kvnode.vllm.connector import KvnodeConnectorMetadata
from kvnode.vllm.plan import BlockMove, StepPlan
from vllm.config import get_current_vllm_config as vc_current

BLOCKS = 8


@pytest.fixture
def fake_gpu_daemon(tmp_path):
    # Each layer-wise fence waits 20 ms, so a layer that landed early would be seen.
    d = Daemon(tmp_path / "d", env={"KVNODE_TEST_FAKE_GPU": "20000"})
    yield d
    d.stop()


class Kv:
    """A file-backed KV allocation and the per-layer views vLLM's runner passes in."""

    def __init__(self, kcc):
        t = kcc.kv_cache_tensors[0]
        self.t = t
        root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.path = os.path.join(root, f"kvnode-vllm-moves-{os.getpid()}-{time.monotonic_ns()}")
        with open(self.path, "wb") as f:
            f.truncate(t.size)
        self.raw = torch.from_file(self.path, shared=True, size=t.size, dtype=torch.uint8)
        self.views = {name: self.raw[i * t.layer_stride:(i + 1) * t.layer_stride].view(torch.float16)
                      for i, name in enumerate(t.layers)}

    def block(self, layer: int, b: int) -> torch.Tensor:
        at = layer * self.t.layer_stride + b * self.t.block_stride
        return self.raw[at:at + self.t.block_stride]

    def export(self, _tensor) -> gpu.ExportedBuffer:
        return gpu.ExportedBuffer(self.path.encode().ljust(64, b"\0"), 0, self.t.size, 0)

    def close(self) -> None:
        os.unlink(self.path)


@pytest.fixture
def worker(model_dir, fake_gpu_daemon):
    """Builds a worker-role connector (page-by-page or layer-wise) over a file-backed KV."""
    with contextlib.ExitStack() as stack:
        def make(layerwise: bool):
            stack.enter_context(one_rank(vllm_config(model_dir, fake_gpu_daemon.socket,
                                                     layerwise_load=layerwise)))
            kcc = kv_cache_config(num_blocks=BLOCKS)
            conn = KvnodeConnector(vc_current(), KVConnectorRole.WORKER, kcc)
            kv = Kv(kcc)
            stack.callback(kv.close)
            stack.callback(conn.shutdown)
            conn.worker._export = kv.export  # the fake GPU's "IPC handle": the file's path
            return conn, kv
        yield make


def _step(conn: KvnodeConnector, plan: StepPlan) -> None:
    conn.bind_connector_metadata(KvnodeConnectorMetadata(plan))


def _save(conn: KvnodeConnector, req: str, digests, blocks) -> None:
    """One step that offloads `blocks`, then steps until get_finished reports the request."""
    _step(conn, StepPlan(saves=[BlockMove(req, digests, blocks)]))
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    deadline = time.monotonic() + 30
    finished = {req}
    while True:
        done, _ = conn.get_finished(finished)
        if done and req in done:
            return
        finished = set()
        assert time.monotonic() < deadline, "the offload never finished"
        time.sleep(0.01)


@pytest.mark.parametrize("layerwise", [False, True], ids=["page-by-page", "layer-wise"])
def test_blocks_saved_through_the_connector_load_back_bitwise_into_other_blocks(worker, layerwise):
    conn, kv = worker(layerwise)
    layers = list(kv.views)
    conn.register_kv_caches(kv.views)
    kv.raw.copy_(torch.randint(1, 255, (kv.t.size,), dtype=torch.uint8))
    orig = kv.raw.clone()
    digests = [bytes([3, i, int(layerwise), 0]) * 8 for i in range(3)]
    _save(conn, "r1", digests, [0, 1, 2])
    kv.raw.zero_()
    # The next step loads the three blocks into blocks 5, 6, 7 (another request's placement).
    _step(conn, StepPlan(loads=[BlockMove("r2", digests, [5, 6, 7])]))
    conn.start_load_kv(None)
    for li, name in enumerate(layers):
        conn.wait_for_layer_load(name)
        # Layer-wise, this layer of every block has landed; later layers may still be on the way.
        for src, dst in ((0, 5), (1, 6), (2, 7)):
            assert torch.equal(kv.block(li, dst), orig[li * kv.t.layer_stride + src * kv.t.block_stride:][:kv.t.block_stride]), (li, dst)
    conn.wait_for_save()  # ends the step's loads (layer-wise: their statuses)
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()
    for li in range(len(layers)):
        for dst in (5, 6, 7):
            src = dst - 5
            assert torch.equal(kv.block(li, dst), orig[li * kv.t.layer_stride + src * kv.t.block_stride:][:kv.t.block_stride])
        for b in (0, 1, 2, 3, 4):
            assert not kv.block(li, b).any(), f"block {b} of layer {li} was written"
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data, "the worker reported no moves"


@pytest.mark.parametrize("layerwise", [False, True], ids=["page-by-page", "layer-wise"])
def test_a_block_the_daemon_does_not_hold_is_reported_as_a_load_error_and_left_untouched(worker, layerwise):
    conn, kv = worker(layerwise)
    conn.register_kv_caches(kv.views)
    kv.raw.fill_(0x5a)
    held = [bytes([9, 0, int(layerwise), 0]) * 8]
    _save(conn, "r1", held, [0])
    missing = bytes([9, 1, int(layerwise), 0]) * 8
    kv.raw.fill_(0x11)
    _step(conn, StepPlan(loads=[BlockMove("r2", held + [missing], [3, 4])]))
    conn.start_load_kv(None)
    for name in kv.views:
        conn.wait_for_layer_load(name)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    # vLLM recomputes exactly the block that was not loaded; the held one landed.
    assert conn.get_block_ids_with_load_errors() == {4}
    for li in range(len(kv.views)):
        assert bool((kv.block(li, 3) == 0x5a).all()), li
        assert bool((kv.block(li, 4) == 0x11).all()), li
