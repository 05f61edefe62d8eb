"""kvnode as vLLM's KV store: a KV connector v1 for vLLM 0.33 (docs/vllm.md).

    --kv-transfer-config '{"kv_connector": "KvnodeConnector",
                           "kv_connector_module_path": "kvnode.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvnode/kvnode.sock"}}'

Only `connector` and `metrics` import vllm; `KvnodeConnector` is resolved lazily so that the
vllm-free modules (keys, config, lookup, plan, scheduler_side, worker_side) import without it.
"""

from typing import Any

__all__ = ["KvnodeConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KvnodeConnector", "KvnodeConnectorMetadata"):
        from kvnode.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvnode.vllm' has no attribute {name!r}")
