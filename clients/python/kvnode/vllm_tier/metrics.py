"""Prometheus metrics of the kvnode tier, through vLLM's offloading stats (imports vllm)."""

from __future__ import annotations

from typing import Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (OffloadingCounterMetadata, OffloadingHistogramMetadata,
                                     OffloadingMetricMetadata)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

PREFIX = "vllm:kv_offload_kvnode_"

#: counter name (after PREFIX) -> help text; every series is labelled with the tier.
COUNTERS: Dict[str, str] = {
    "lookup_calls": "Exists calls the tier's lookup threads sent to the kvnode daemon",
    "lookup_keys": "chunk keys looked up in the kvnode daemon",
    "lookup_hits": "chunk keys the kvnode daemon held when asked",
    "lookup_errors": "lookup batches answered as misses because the daemon failed or was down",
    "plan_cut_keys": "chunk keys the daemon held but its fetch plan left to recompute (recompute_tokens_per_s)",
    "hinted_pulls": "router-hinted pulls the daemon started from a peer",
    "hinted_pulled_blocks": "blocks the daemon pulled from a peer for a hinted request",
    "load_blocks": "chunks loaded from kvnode into the primary tier",
    "load_failed_blocks": "chunks whose load failed (recomputed by vLLM)",
    "load_failed_jobs": "load jobs reported failed (all or part of their chunks)",
    "store_blocks": "chunks stored into kvnode (new or already present)",
    "store_failed_blocks": "chunks kvnode did not store (no space, daemon down, ...)",
    "store_failed_jobs": "store jobs reported failed",
    "touches": "touches (vLLM's touch: chunks marked recently used) the daemon answered",
    "touched_keys": "chunk keys the daemon found in DRAM and refreshed by those touches",
    "touch_errors": "touches refused or not delivered (logged at debug)",
    "actions_sent": "router actions (other than kv.fetch) sent to the kvnode daemon in an Act",
    "actions_refused": "router actions the daemon refused, or that never reached it (logged at warning)",
}
LOOKUP_RTT = PREFIX + "lookup_rtt_seconds"
_RTT_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0)


def definitions() -> Dict[str, OffloadingMetricMetadata]:
    out: Dict[str, OffloadingMetricMetadata] = {
        PREFIX + name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
        for name, doc in COUNTERS.items()
    }
    out[LOOKUP_RTT] = OffloadingHistogramMetadata(
        documentation="round trip of one Exists call to the kvnode daemon, in seconds",
        labelnames=(TIER_LABEL,), buckets=_RTT_BUCKETS)
    return out


def stats(label: str, counters: Dict[str, float], rtts: List[float]):
    """An OffloadingConnectorStats of the given deltas, or None when there are none."""
    if not any(counters.values()) and not rtts:
        return None
    s = OffloadingConnectorStats()
    for name, v in counters.items():
        if v and name in COUNTERS:
            s.increase_counter(PREFIX + name, v, (label,))
    for r in rtts:
        s.observe_histogram(LOOKUP_RTT, r, (label,))
    return s
