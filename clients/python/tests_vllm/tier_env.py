"""Helpers of the kvnode-tier tests: a real vLLM 0.33 OffloadingConnector (scheduler role) with
TieringOffloadingSpec, whose secondary tier is `KvnodeTier` loaded by module_path, and calls into
vLLM's real TieringOffloadingManager the way OffloadingConnectorScheduler makes them."""

from __future__ import annotations

import os
import time
import uuid
from typing import Dict, List, Optional, Sequence

import numpy as np
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_hints import KvHintsEnvelope
from vllm.v1.kv_hints.protocol import KvHintAction
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from conftest import BLOCK, make_request, make_scheduler

ROW = 4096  # bytes of one chunk of the tiny test model (2 layers x 2048-byte pages)
_STEP = ScheduleEndContext((), ())


def tier_vllm_config(model_dir: str, socket: str, chunks: int = 16, tier: Optional[dict] = None,
                     extra: Optional[dict] = None):
    """A VllmConfig whose kv_transfer_config is OffloadingConnector + TieringOffloadingSpec with
    the kvnode tier given by type and module_path (exactly what an operator writes)."""
    tier = dict(tier or {})
    if tier.get("type", "KvnodeTier") == "KvnodeTier":
        tier_cfg = {"type": "KvnodeTier", "module_path": "kvnode.vllm_tier", "socket": socket,
                    "io_timeout_s": 2.0, "hint_wait_s": 2.0, **tier}
    else:  # one of vLLM's in-tree tiers (the benchmark's side-by-side runs)
        tier_cfg = tier
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=f"kvt-{uuid.uuid4().hex[:12]}",
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec",
                                   "cpu_bytes_to_use": chunks * ROW * int((extra or {}).get("blocks_per_chunk", 1)),
                                   "secondary_tiers": [tier_cfg], **(extra or {})},
        kv_load_failure_policy="recompute")
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"
    return VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))


class Engine:
    """One vLLM engine's scheduler: its TieringOffloadingManager, primary view and kvnode tier."""

    def __init__(self, model_dir: str, socket: str, chunks: int = 16, tier: Optional[dict] = None,
                 kcc=None, extra: Optional[dict] = None):
        self.sched = make_scheduler(tier_vllm_config(model_dir, socket, chunks, tier, extra), kcc)
        make_request("init-none-hash", [3] * 20)  # the engine core's init_none_hash(sha256)
        self.m = self.sched.connector.connector_scheduler.manager
        self.tier = self.m.secondary_tiers[0]
        self.view = self.m.primary_tier.get_kv_memoryview()
        self.rows = np.asarray(self.view).view(np.uint8)
        self.finished: List = []
        self._wrap_finished()

    def _wrap_finished(self):
        """Records every JobResult the manager receives from the tier (the test's window on
        'job reported failed'); the manager's own handling is unchanged."""
        inner = self.tier.get_finished_jobs

        def spy():
            out = list(inner())
            self.finished.extend(out)
            return out
        self.tier.get_finished_jobs = spy

    def close(self):
        self.rows = None  # drop the test's export of the primary mapping before vLLM unmaps it
        self.sched.connector.shutdown()

    def step(self):
        with self.m.lock:
            self.m.on_schedule_end(_STEP)

    def row(self, chunk: int) -> bytes:
        return self.rows[chunk].tobytes()

    def settle(self, limit_s: float = 10.0):
        t0 = time.monotonic()
        while True:
            self.step()
            with self.m.lock:  # every transfer job the manager registered has finished
                if not self.m._jobs:  # (has_pending_work stays True for tiers that poll peers)
                    return
            if time.monotonic() - t0 > limit_s:
                raise AssertionError("tier jobs still pending")
            time.sleep(0.002)

    def store(self, keys: Sequence[bytes], rows: Sequence[bytes], req_id: Optional[str] = None):
        """GPU -> primary (written by hand, as the worker would) -> cascade to the tier."""
        ctx = ReqContext(req_id=req_id or f"st-{uuid.uuid4().hex[:8]}")
        with self.m.lock:
            self.m.on_new_request(ctx)
            out = self.m.prepare_store(list(keys), ctx)
            assert out is not None and list(out.keys_to_store) == list(keys), out
            for c, b in zip(out.store_spec.chunk_ids, rows):
                self.rows[int(c)] = np.frombuffer(b, np.uint8)
            self.m.complete_store(list(keys), ctx, True)
            self.m.on_request_finished(ctx)
        self.settle()

    def lookup(self, keys: Sequence[bytes], ctx: ReqContext, limit_s: float = 10.0):
        """The scheduler's prefix lookup, stepped until it is decided: (hits, steps, seconds)."""
        t0, steps = time.monotonic(), 0
        while True:
            hits, deferred = 0, False
            with self.m.lock:
                for k in keys:
                    r = self.m.lookup(k, ctx)
                    if r is LookupResult.MISS:
                        break
                    hits += 1
                    deferred |= r is not LookupResult.HIT
            if not deferred:
                return hits, steps, time.monotonic() - t0
            if time.monotonic() - t0 > limit_s:
                raise AssertionError(f"lookup not decided in {limit_s}s")
            self.step()
            steps += 1
            time.sleep(0.002)

    def read_loaded(self, keys: Sequence[bytes], ctx: ReqContext) -> List[bytes]:
        """prepare_load -> the primary rows a GPU load would read -> complete_load."""
        with self.m.lock:
            spec = self.m.prepare_load(list(keys), ctx)
            rows = [self.row(int(c)) for c in spec.chunk_ids]
            self.m.complete_load(list(keys), ctx)
        return rows

    def in_primary(self, key: bytes, ctx: ReqContext) -> bool:
        with self.m.lock:
            return self.m.primary_tier.lookup(key, ctx) is LookupResult.HIT

    def failed_loads(self) -> list:
        return [r for r in self.finished if not r.success]


def keys_and_rows(n: int, group: int = 0, seed: Optional[bytes] = None):
    hashes = [os.urandom(32) for _ in range(n)]
    return ([make_offload_key(h, group) for h in hashes], [os.urandom(ROW) for _ in range(n)], hashes)


def hint_envelope(port: int, hashes) -> KvHintsEnvelope:
    """Dynamo's kv.fetch action as vLLM types it (ReqContext.kv_hints), with router hashes."""
    return KvHintsEnvelope(protocol_version="0.1", message_id="m-1", actions=[KvHintAction(
        action_id="a-1", action_type="kv.fetch", action_version="1.0",
        payload={"source_control_endpoint": f"tcp://127.0.0.1:{port}", "mode": "copy",
                 "block_hashes": [maybe_convert_block_hash(h) for h in hashes]})])


def counters(stats) -> Dict[str, float]:
    """Flat {metric: value} of the kvnode counters in an OffloadingConnectorStats."""
    if stats is None:
        return {}
    return {k.split(":(")[0]: v for k, v in stats.reduce().items() if "kvnode" in k}


def until_promotions_pending(e: "Engine", keys: Sequence[bytes], ctx: ReqContext, limit_s: float = 10.0):
    """Steps lookups until the tier said HIT for every key and the manager has queued their
    promotion (HIT_PENDING), but before the next step submits the load job."""
    t0 = time.monotonic()
    while True:
        with e.m.lock:
            res = [e.m.lookup(k, ctx) for k in keys]
        if all(r is LookupResult.HIT_PENDING for r in res):
            return
        assert LookupResult.MISS not in res, res
        assert time.monotonic() - t0 < limit_s, res
        e.step()
        time.sleep(0.002)


def freeze(proc, limit_s: float = 5.0) -> None:
    """SIGSTOP, then wait until every thread of the process is stopped: kill() returns before
    the target's threads stop, and on a loaded machine they may serve a request meanwhile."""
    import glob
    import signal
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    while True:
        states = []
        for t in glob.glob(f"/proc/{proc.pid}/task/*/stat"):
            try:
                states.append(open(t).read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() - t0 < limit_s, f"process {proc.pid} not stopped: {states}"
        time.sleep(0.001)
