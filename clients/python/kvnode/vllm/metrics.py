"""vLLM stats and Prometheus metrics of the kvnode connector (imports vllm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: Counter name -> help text. Worker counters come from WorkerSide.stats, scheduler ones from
#: SchedulerSide; every value is a delta since the last report.
COUNTERS: Dict[str, str] = {
    "load_blocks": "vLLM blocks onloaded from kvnode by daemon DMA",
    "load_errors": "vLLM blocks whose onload failed (recomputed by vLLM)",
    "load_s": "seconds workers waited for onloads",
    "save_blocks": "vLLM blocks offered to kvnode for offload",
    "save_stored": "vLLM block segments newly stored by kvnode",
    "save_s": "seconds the save thread spent in offloads",
    "lookups": "prefix lookups sent to kvnode",
    "hit_tokens": "prompt tokens served from kvnode",
    "pending_answers": "scheduler asks answered 'not yet' (lookup or hinted pull pending)",
    "touches": "touches of vLLM's own prefix-cache hits the daemon answered",
    "touched_blocks": "vLLM blocks the daemon found in DRAM and refreshed by those touches",
    "touch_errors": "touches refused or not delivered (logged at debug; the request is unaffected)",
    "actions_sent": "router actions (other than kv.fetch) sent to kvnode in an Act",
    "actions_refused": "router actions kvnode refused, or that never reached it (logged at warning)",
}


@dataclass
class KvnodeConnectorStats(KVConnectorStats):
    """Summable counters (see COUNTERS)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvnodeConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvnodePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per COUNTERS entry, `vllm:kvnode_<name>`, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:kvnode_{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*vals)
                                    for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine and value:
                per_engine[engine_idx].inc(value)


def delta(now: Dict[str, float], last: Dict[str, float]) -> Dict[str, float]:
    """Counter increments since `last` (which is updated to `now`)."""
    out = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
    last.update(now)
    return out
