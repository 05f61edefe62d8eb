"""Connector stats and Prometheus metrics through vLLM's own classes (prometheus_client)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conftest import make_request, make_scheduler, vllm_config
from kvnode.vllm import KvnodeConnector
from test_scheduler_side import deposit, prompt


def test_stats_flow_into_prometheus_counters(daemon, model_dir):
    vc = vllm_config(model_dir, daemon.socket, lookup_wait_ms=5000)
    s = make_scheduler(vc)
    req = make_request("m", prompt(31, 4))
    deposit(daemon.socket, s.connector.spec, req.block_hashes[:2])
    s.add_request(req)
    s.schedule()
    stats = s.connector.get_kv_connector_stats()
    assert stats.data["lookups"] == 1 and stats.data["hit_tokens"] == 32
    assert s.connector.get_kv_connector_stats() is None, "stats are deltas"
    # vLLM aggregates worker and scheduler stats with the connector class's own builder.
    agg = KvnodeConnector.build_kv_connector_stats(dict(stats.data)).aggregate(
        KvnodeConnector.build_kv_connector_stats({"load_blocks": 2, "hit_tokens": 16}))
    assert agg.reduce()["hit_tokens"] == 48 and not agg.is_empty()

    registry = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                kw.setdefault("registry", registry)
                super().__init__(*a, **kw)
        return Bound

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    prom = KvnodeConnector.build_prom_metrics(vc, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(agg.reduce(), engine_idx=0)
    assert registry.get_sample_value("vllm:kvnode_hit_tokens_total", {"model_name": "tiny", "engine": "0"}) == 48
    assert registry.get_sample_value("vllm:kvnode_load_blocks_total", {"model_name": "tiny", "engine": "0"}) == 2
