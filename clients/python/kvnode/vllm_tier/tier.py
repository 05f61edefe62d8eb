"""`KvnodeTier`: the node's kvnode daemon as a secondary tier of vLLM 0.33's OffloadingConnector.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{"type": "KvnodeTier", "module_path": "kvnode.vllm_tier",
                             "socket": "/run/kvnode/kvnode.sock"}]}}'

Every method runs on vLLM's scheduler thread under the tiering manager's lock and returns at
once: lookups go to vLLM's AsyncLookupManager (kvnode.vllm_tier.lookup), loads and stores to
the transfer threads (kvnode.vllm_tier.jobs). docs/vllm.md "Secondary tier" has the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional

import msgspec
from vllm.v1.kv_offload.base import (ConfigInfoMapping, Locality, LookupResult, Medium,
                                     OffloadingMetricMetadata, OffloadKey, ReqContext,
                                     RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvnode.actions import COMPLETION, NOW, ActionLog, ActionSender
from kvnode.hints import extract_router_hint, request_source, split_envelope
from kvnode.touch import MAX_TOUCH_KEYS, TouchLog
from kvnode.vllm_tier import metrics
from kvnode.vllm_tier.config import TierConfig
from kvnode.vllm_tier.jobs import Job, Transfers
from kvnode.vllm_tier.lookup import Actions, DaemonLookup, Hint, LookupCounters
from kvnode.vllm_tier.namespace import UnsupportedLayout, check_layout, namespace_spec, wire_key
from kvnode.vllm_tier.primary import close_extents, shared_extents, view_base
from kvnode.wire import Connection, KvnodeError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvnode.vllm_tier")


def _source(req_context: ReqContext) -> Any:
    hints = req_context.kv_hints
    return request_source(None if hints is None else msgspec.to_builtins(hints),
                          req_context.kv_transfer_params)


def request_hint(req_context: ReqContext) -> Optional[dict]:
    """The request's kv.fetch hint: vLLM's `kv_hints` envelope (what the in-tree kvcr tier
    reads), else the connector's forms in `kv_transfer_params`; None when absent or malformed."""
    return extract_router_hint(_source(req_context))


class KvnodeTier(SecondaryTierManager):
    """kvnode as a secondary tier: chunks live in the daemon's DRAM/NVMe tiers, shared by every
    engine on the node and reachable by peers through router hints."""

    medium: ClassVar[Medium] = Medium.CPU

    @classmethod
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, OffloadingMetricMetadata]:
        return metrics.definitions()

    @classmethod
    def config_info_keys(cls, tier_config: Dict[str, Any]) -> tuple:
        return ("kvnode_copy",)

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: "BackpressureDetector | None" = None, **kwargs: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.cfg = TierConfig.parse(kwargs)
        self.locality = Locality(self.cfg.locality)
        self._config = offloading_spec.config
        row = self.block_size_bytes
        nseg = check_layout(self._config, row)
        self._label = _tier_label(offloading_spec, tier_type, kwargs)
        base, nbytes = view_base(primary_kv_view), primary_kv_view.nbytes
        extents, why = ([], "copy = \"arena\"") if self.cfg.copy == "arena" else shared_extents(base, nbytes)
        if not extents and self.cfg.copy == "region":
            raise UnsupportedLayout(f"kvnode tier: copy = \"region\" but {why}")
        self._extents = extents
        self.copy_mode = "region" if extents else "arena"
        self._spec: Optional[dict] = None
        self._probe(row, why)
        windowed = {int(g.group_id) for g in self._config.groups
                    if g.sliding_window_size_in_chunks is not None}
        self._counters = LookupCounters()
        self._io: Dict[str, float] = {}
        # Router actions other than kv.fetch: immediate ones from the lookup threads, deferred
        # ones (request_completion) from their own thread once the request ended.
        self.actions = ActionLog(logger)
        self._actions_reported: Dict[str, int] = {}
        self._sender = ActionSender(self._connect, self._register, self.actions, "kvnode-tier-actions")
        # vLLM's touch (chunks to mark recently used): a `Touch` on the sender's thread.
        self.touches = TouchLog(logger)
        self._touches_reported: Dict[str, int] = {}
        self._ended: Dict[str, Actions] = {}  # ended requests whose stores are still running
        self._job_req: Dict[int, Actions] = {}  # store job -> its request's actions
        # Fetch plans (kvnode.plan): the cost, each group's chunk tokens, how loads read.
        plans = dict(recompute=self.cfg.recompute(), via="region" if extents else "copy",
                     chunk_tokens={int(g.group_id): int(g.tokens_per_block) * int(self._config.cache.blocks_per_chunk)
                                   for g in self._config.groups})
        self._plain = DaemonLookup(tier_type, self._connect, self._register, windowed, False,
                                   self.cfg.hint_wait_s, self._counters, self.actions, **plans)
        self._hinted = DaemonLookup(tier_type, self._connect, self._register, windowed, True,
                                    self.cfg.hint_wait_s, self._counters, self.actions, **plans)
        self._transfers = Transfers(self._connect, self._register, nseg, row, base, extents,
                                    self.cfg.threads)
        self._jobs: Dict[int, list] = {}
        logger.info("kvnode tier %s: socket %s, rows of %d bytes, %d group segment(s), copy %s",
                    self._label, self.cfg.socket, row, nseg, self.copy_mode)

    # -- daemon ----------------------------------------------------------------------------
    def _connect(self) -> Connection:
        return Connection(self.cfg.socket, client="kvnode-vllm-tier", timeout=self.cfg.io_timeout_s)

    def _namespace(self) -> dict:
        if self._spec is None:
            from vllm.v1.core import kv_cache_utils  # NONE_HASH is set once the engine core is up
            self._spec = namespace_spec(self._config, self.block_size_bytes,
                                        getattr(kv_cache_utils, "NONE_HASH", None),
                                        self.cfg.model_name, self.cfg.tenant_salt)
        return self._spec

    def _register(self, conn: Connection) -> int:
        return conn.register(self._namespace())["ns"]

    def _probe(self, row: int, why: Optional[str]) -> None:
        """Refuses at start what the daemon would refuse on every call (a row over its slab
        size, no arena for the copy path); a daemon not up yet is only logged."""
        try:
            conn = self._connect()
        except OSError as e:
            logger.warning("kvnode tier: daemon %s not reachable yet (%s): lookups miss and jobs "
                           "fail until it is", self.cfg.socket, e)
            return
        try:
            spec = namespace_spec(self._config, row, b"kvnode-start-probe", self.cfg.model_name,
                                  self.cfg.tenant_salt)
            try:
                conn.register(spec)
            except KvnodeError as e:
                raise UnsupportedLayout(f"kvnode tier: the daemon refuses rows of {row} bytes "
                                        f"x {len(spec['segments'])} group(s): {e}") from e
            if not self._extents and conn.arena is None:
                raise UnsupportedLayout(f"kvnode tier: no zero copy ({why}) and this client's "
                                        "tenant has no arena mapping (share_arena = false)")
        finally:
            conn.close()

    # -- SecondaryTierManager --------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hint = request_hint(req_context)
        if hint is not None:
            req_context.set_state(Hint(hint))
        acts = split_envelope(_source(req_context))
        if acts is not None:
            req_context.set_state(Actions(acts))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        mgr = self._hinted if req_context.get_state(Hint) is not None else self._plain
        found = mgr.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """vLLM marks `keys` recently used (its base class names chunks its GPU prefix cache
        holds): a kvnode `Touch` of the leading MAX_TOUCH_KEYS, queued to the actions thread
        (this is the scheduler thread). vLLM 0.33's OffloadingConnector never calls it."""
        if not self.cfg.touch_gpu_hits or not keys:
            return
        wk = []
        for k in keys:
            if len(wk) == MAX_TOUCH_KEYS:
                break
            wk.append(wire_key(k))
        self._sender.submit_touch(wk, self.touches)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, True)

    def _submit(self, jm: TransferJob, is_load: bool) -> None:
        keys = list(jm.keys)
        self._jobs[jm.job_id] = keys
        state = jm.req_context.get_state(Actions) if jm.req_context is not None else None
        if state is not None and not is_load:
            state.saw(keys)  # deferred actions run on the blocks the request stored too
            self._job_req[jm.job_id] = state
        self._transfers.submit(Job(jm.job_id, is_load, keys, [int(c) for c in jm.chunk_ids]))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for o in self._transfers.finished():
            keys = self._jobs.pop(o.job_id)
            self._store_done(self._job_req.pop(o.job_id, None), keys)
            good = sum(o.ok)
            kind = "load" if o.is_load else "store"
            self._count(f"{kind}_blocks", good)
            self._count(f"{kind}_failed_blocks", len(keys) - good)
            success = good == len(keys)
            if not success:
                self._count(f"{kind}_failed_jobs", 1)
            partial = None
            if o.is_load and not success:
                failed = [k for k, ok in zip(keys, o.ok) if not ok]
                self._plain.mark_miss(failed)
                self._hinted.mark_miss(failed)
                if good:
                    partial = tuple(k for k, ok in zip(keys, o.ok) if ok)
            results.append(JobResult(job_id=o.job_id, success=success, successful_keys=partial,
                                     transfer_time=o.seconds, transfer_bytes=o.nbytes))
        return results

    def has_pending_work(self) -> bool:
        return self._transfers.pending() > 0

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._plain.flush()
        self._hinted.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._plain.cleanup(req_context.req_id)
        self._hinted.cleanup(req_context.req_id)
        state = req_context.get_state(Actions)
        if state is None:
            return
        if any(s is state for s in self._job_req.values()):
            self._ended[req_context.req_id] = state  # finished once its stores are done
        else:
            self._finish(state)

    def _store_done(self, state: Optional[Actions], keys: List[OffloadKey]) -> None:
        """A store job of a request with actions ended: its immediate actions run on the
        stored keys (from the sender thread: this is vLLM's scheduler thread); a request that
        ended and has no store left gets its request_completion actions."""
        if state is None:
            return
        self._send(state, NOW, keys)
        if any(s is state for s in self._job_req.values()):
            return
        ended = [r for r, s in self._ended.items() if s is state]
        for r in ended:
            del self._ended[r]
            self._finish(state)

    def _send(self, state: Actions, phase: str, keys: List[OffloadKey]) -> None:
        text = state.acts.now_text() if phase == NOW else state.acts.completion_text()
        if text is None:
            return
        claimed = self.actions.claim(state.acts, phase, Actions.SCOPE, [wire_key(k) for k in keys])
        if claimed is not None and phase == NOW:
            state.sent_now = True
        self._sender.submit(claimed, state.acts, phase, text, Actions.SCOPE)

    def _finish(self, state: Actions) -> None:
        """The request ended: its request_completion actions on every key it looked up or
        stored, and its immediate ones if no lookup or store ever sent them."""
        keys = state.keys()
        if not state.sent_now:
            self._send(state, NOW, keys)
        self._send(state, COMPLETION, keys)

    def take_events(self) -> Iterable:
        # The daemon publishes its own KV events (CPU_PINNED / DISK, docs/events.md) for every
        # block any engine or peer pull stores in it; publishing them here too would announce
        # each block twice (Dynamo keeps no reference counts).
        return ()

    def drain_jobs(self) -> None:
        self._transfers.drain()

    def shutdown(self) -> None:
        self._plain.shutdown()
        self._hinted.shutdown()
        self._sender.close()
        self._transfers.close()
        close_extents(self._extents)
        self._extents = []

    def get_stats(self):
        counters, rtts = self._counters.take()
        for k, v in self._io.items():
            counters[k] = counters.get(k, 0) + v
        self._io = {}
        for k, total in self.actions.take().items():
            counters[k] = counters.get(k, 0) + total - self._actions_reported.get(k, 0)
            self._actions_reported[k] = total
        for k, total in self.touches.totals().items():
            counters[k] = counters.get(k, 0) + total - self._touches_reported.get(k, 0)
            self._touches_reported[k] = total
        return metrics.stats(self._label, counters, rtts)

    def config_info(self) -> ConfigInfoMapping:
        return {"kvnode_copy": self.copy_mode}

    def _count(self, name: str, n: float) -> None:
        if n:
            self._io[name] = self._io.get(name, 0) + n


def _tier_label(spec: Any, tier_type: str, kwargs: Dict[str, Any]) -> str:
    """The tier label vLLM's tiering metrics use for this tier: "<index + 1>:<type>"."""
    for i, tc in enumerate(getattr(spec, "secondary_tier_configs", None) or []):
        if tc.get("type") == tier_type and all(tc.get(k) == v for k, v in kwargs.items()):
            return f"{i + 1}:{tier_type}"
    return tier_type
