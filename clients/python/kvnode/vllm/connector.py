"""`KvnodeConnector`: the thin vLLM 0.33 KV connector v1 class over the vllm-free halves.

Scheduler role: SchedulerSide + LookupService (a background thread with its own daemon
connection). Worker role: WorkerSide (daemon DMA into vLLM's one KV allocation). This file only
translates vLLM objects into plain values; the behaviour is in scheduler_side / worker_side.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvnode.hints import extract_router_hint, request_source, split_envelope
from kvnode.vllm.config import KvnodeVllmConfig
from kvnode.vllm.keys import RankGeometry, Segment
from kvnode.vllm.lookup import LookupService
from kvnode.vllm.metrics import KvnodeConnectorStats, KvnodePromMetrics, delta
from kvnode.vllm.plan import StepPlan
from kvnode.vllm.scheduler_side import SchedulerSide
from kvnode.vllm.worker_side import Placement, WorkerSide
from kvnode.wire import Connection

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvnode.vllm")


class KvnodeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one StepPlan."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


def _single_group_spec(kv_cache_config: "KVCacheConfig"):
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(
            f"kvnode connector: this model has {len(groups)} KV cache groups ({kinds}); kvnode keys "
            "one block table per request and supports only models with one full-attention (or "
            "MLA) group. Hybrid models (sliding window, Mamba, local attention) are refused: "
            "start vLLM with --disable-hybrid-kv-cache-manager if the model allows it.")
    spec = groups[0].kv_cache_spec
    if (not isinstance(spec, FullAttentionSpec)
            or isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec))):
        raise ValueError(f"kvnode connector: KV cache spec {type(spec).__name__} is not supported "
                         "(full attention and MLA only)")
    return groups[0], spec


def _ranks(role: KVConnectorRole) -> Dict[str, int]:
    if role != KVConnectorRole.WORKER:
        return {"tp_rank": 0, "pp_rank": 0, "dcp_rank": 0}
    from vllm.distributed.parallel_state import get_dcp_group, get_pp_group, get_tensor_model_parallel_rank

    out = {"tp_rank": get_tensor_model_parallel_rank(), "pp_rank": get_pp_group().rank_in_group}
    try:
        out["dcp_rank"] = get_dcp_group().rank_in_group
    except AssertionError:  # no DCP group initialised
        out["dcp_rank"] = 0
    return out


def rank_geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                  cfg: KvnodeVllmConfig, ranks: Dict[str, int]) -> Tuple[RankGeometry, int]:
    """The namespace facts of this rank and the hash block size."""
    group, spec = _single_group_spec(kv_cache_config)
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    page = spec.page_size_bytes
    tensors = [t for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    if tensors:
        segments = tuple(Segment(len(t.layers), page) for t in tensors)
    else:  # a scheduler-only config (tests): one tensor holding every layer
        segments = (Segment(len(group.layer_names), page),)
    geo = RankGeometry(
        model=cfg.model_name or str(vllm_config.model_config.model),
        dtype=f"{cache.cache_dtype}:{str(spec.dtype).replace('torch.', '')}",
        block_size=spec.block_size,
        layout=str(cache.kv_cache_layout or "default"),
        hash_algo=str(cache.prefix_caching_hash_algo),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        num_layers=len(group.layer_names),
        segments=segments,
        tp_rank=ranks["tp_rank"], tp_size=par.tensor_parallel_size,
        pp_rank=ranks["pp_rank"], pp_size=par.pipeline_parallel_size,
        dcp_rank=ranks["dcp_rank"], dcp_size=par.decode_context_parallel_size,
        mla=isinstance(spec, MLAAttentionSpec),
        tenant_salt=cfg.tenant_salt,
    )
    hash_block = cache.hash_block_size or spec.block_size
    return geo, hash_block


class KvnodeConnector(KVConnectorBase_V1):
    """kvnode as vLLM's KV store (docs/vllm.md)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = KvnodeVllmConfig.parse(ktc.kv_connector_extra_config, ktc.kv_role)
        self.geometry, hash_block = rank_geometry(vllm_config, kv_cache_config, self.cfg, _ranks(role))
        self.spec = self.geometry.namespace_spec()
        self._requests: Dict[str, "Request"] = {}
        self._last_stats: Dict[str, float] = {}
        self.sched: Optional[SchedulerSide] = None
        self.worker: Optional[WorkerSide] = None
        self._admin: Optional[Connection] = None
        if role == KVConnectorRole.SCHEDULER:
            lookup = LookupService(self._connect, lambda c: c.register(self.spec)["ns"],
                                   len(self.spec["segments"]), self.cfg.hint_wait_s,
                                   recompute=self.cfg.recompute(),
                                   block_tokens=self.geometry.block_size, via="gpu")
            self.sched = SchedulerSide(lookup, self.geometry.block_size, hash_block,
                                       self.cfg.lookup_wait_ms / 1000.0, self.cfg.load, self.cfg.save,
                                       steps_in_flight=vllm_config.max_concurrent_batches,
                                       touch=self.cfg.touch_gpu_hits)
        else:
            self.worker = WorkerSide(self._connect, self.spec, layerwise=self.cfg.layerwise_load)
        self._layer_of: Dict[str, Tuple[int, int]] = {}  # layer name -> (segment, layer in it)
        logger.info("kvnode connector (%s) on %s, namespace %s", role.name, self.cfg.socket,
                    {k: self.spec[k] for k in ("model", "dtype", "page_size", "layout", "tp_rank", "segments")})

    def _connect(self) -> Connection:
        return Connection(self.cfg.socket, client=f"vllm-{self.role.name.lower()}",
                          timeout=self.cfg.connect_timeout_s)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """Block-outermost by default: a block's layers are one contiguous run, so the daemon
        moves each block with one DMA (docs/vllm.md, throughput). vLLM keeps its own choice,
        with a warning, when the attention backends cannot use it."""
        ktc = vllm_config.kv_transfer_config
        cfg = KvnodeVllmConfig.parse(ktc.kv_connector_extra_config, ktc.kv_role)
        return cfg.kv_cache_layout or None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the daemon maps the KV allocation by CUDA IPC; sleep mode remaps it

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped offload is a later miss, never a wrong answer

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        assert self.worker is not None
        spec = self.spec
        tensors = [t for t in self._kv_cache_config.kv_cache_tensors if not t.host_resident]
        page = self.geometry.segments[0].page_bytes
        placements = []
        for t in tensors:
            view = kv_caches[t.layers[0]]
            off = view.storage_offset() * view.element_size()
            if off != t.offset:
                raise ValueError(f"kvnode connector: layer {t.layers[0]} starts at byte {off} of the KV "
                                 f"allocation, but its KVCacheTensor says {t.offset}")
            placements.append(Placement(t.offset, t.layer_stride, t.block_stride, len(t.layers), page,
                                        self._kv_cache_config.num_blocks_of(t)))
        self._layer_of = {name: (seg, i) for seg, t in enumerate(tensors) for i, name in enumerate(t.layers)}
        self.worker.register(kv_caches[tensors[0].layers[0]], placements)
        logger.info("kvnode connector: attached %d KV tensor(s), %d bytes per block, %d blocks",
                    len(placements), sum(spec["segments"]), placements[0].num_blocks)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvnodeConnectorMetadata)
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, KvnodeConnectorMetadata):
            self.worker.drain(kv_connector_metadata.plan.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.run_step_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise loads: blocks until this layer of the step's onloads landed (the daemon
        copies layers in model order, so the first layers compute while later ones arrive).
        Page-by-page loads finished in start_load_kv already."""
        assert self.worker is not None
        where = self._layer_of.get(layer_name)
        if where is not None:
            self.worker.wait_step_layer(*where)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # offloads are issued once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.end_step_loads()  # layer-wise: the step's load statuses (errors -> recompute)
        if self.has_connector_metadata():
            self.worker.save(self._plan().saves)

    def get_finished(self, finished_req_ids: Set[str]):
        assert self.worker is not None
        done = self.worker.finished(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> Optional[KvnodeConnectorStats]:
        now: Dict[str, float] = {}
        if self.worker is not None:
            now.update(self.worker.stats)
        if self.sched is not None:
            now.update(lookups=self.sched.lookups, hit_tokens=self.sched.hit_tokens,
                       pending_answers=self.sched.pending_answers)
            now.update(self.sched.lookup.actions.take())
            t = self.sched.lookup.touches.totals()
            nseg = max(1, len(self.spec["segments"]))
            now.update(touches=t["touches"], touched_blocks=t["touched_keys"] // nseg,
                       touch_errors=t["touch_errors"])
        d = delta(now, self._last_stats)
        return KvnodeConnectorStats(data=d) if d else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KvnodeConnectorStats:
        return KvnodeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvnodePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            self.sched.lookup.close()
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    # ==== scheduler side ================================================================
    @staticmethod
    def _source(request: "Request") -> Any:
        """The request's envelope: `Request.kv_hints`, else `kv_transfer_params`."""
        return request_source(getattr(request, "kv_hints", None),
                              getattr(request, "kv_transfer_params", None))

    def _hint(self, request: "Request") -> Optional[dict]:
        return extract_router_hint(self._source(request))

    def _send_actions(self, request: "Request") -> None:
        """The request's actions other than kv.fetch, at the earliest call (once per envelope)."""
        assert self.sched is not None
        self.sched.submit_actions(request.request_id, split_envelope(self._source(request)),
                                  request.block_hashes, request.num_tokens)

    def on_new_request(self, request: "Request") -> None:
        assert self.sched is not None
        self._requests[request.request_id] = request
        if not request.skip_reading_prefix_cache:
            self.sched.submit_lookup(request.request_id, request.block_hashes, request.num_tokens,
                                     self._hint(request))
        self._send_actions(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        assert self.sched is not None
        self._requests[request.request_id] = request
        n = self.sched.matched_tokens(request.request_id, request.block_hashes, request.num_tokens,
                                      num_computed_tokens, self._hint(request))
        self._send_actions(request)
        return (None, False) if n is None else (n, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.sched.after_alloc(request.request_id, request.block_hashes, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.sched is not None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        scheduled = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or n <= 0:
                continue
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None and self._kv_cache_manager is not None:
                ids = self._kv_cache_manager.get_block_ids(req_id)
            if not ids:
                continue
            scheduled.append((req_id, req.block_hashes, ids[0], req.num_computed_tokens + n))
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        return KvnodeConnectorMetadata(self.sched.build_plan(scheduled, preempted))

    def update_connector_output(self, connector_output: Any) -> None:
        if self.sched is None:
            return
        self.sched.finished_sending(connector_output.finished_sending)
        invalid = set(connector_output.invalid_block_ids or ())
        if invalid and self._kv_cache_manager is not None:
            by_req = {}
            for req_id in self._requests:
                try:
                    by_req[req_id] = self._kv_cache_manager.get_block_ids(req_id)[0]
                except (KeyError, AssertionError):
                    continue
            self.sched.load_failed(by_req, invalid)

    def request_finished(self, request: "Request", block_ids: list) -> Tuple[bool, Optional[dict]]:
        assert self.sched is not None
        self._requests.pop(request.request_id, None)
        return self.sched.request_finished(request.request_id, request.block_hashes), None

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache: clears this namespace in the daemon."""
        try:
            if self._admin is None:
                self._admin = self._connect()
            ns = self._admin.register(self.spec)["ns"]
            self._admin.clear(ns)
            return True
        except OSError as e:
            logger.warning("kvnode reset_cache failed: %s", e)
            return False
