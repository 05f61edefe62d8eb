"""kvnode as a secondary tier of vLLM 0.33's OffloadingConnector (docs/vllm.md, "Secondary tier").

    "secondary_tiers": [{"type": "KvnodeTier", "module_path": "kvnode.vllm_tier",
                         "socket": "/run/kvnode/kvnode.sock"}]

vLLM's tier factory imports this module and reads the attribute named by `type`. Only `tier`,
`lookup` and `metrics` import vllm; `KvnodeTier` is resolved lazily so that the vllm-free modules
(config, namespace, primary, jobs) import without it.
"""

from typing import Any

__all__ = ["KvnodeTier"]


def __getattr__(name: str) -> Any:
    if name == "KvnodeTier":
        from kvnode.vllm_tier.tier import KvnodeTier

        return KvnodeTier
    raise AttributeError(f"module 'kvnode.vllm_tier' has no attribute {name!r}")
