"""Settings of the kvnode secondary tier: the keys of its `secondary_tiers` entry (no vllm import).

    {"type": "KvnodeTier", "module_path": "kvnode.vllm_tier", "socket": "/run/kvnode/kvnode.sock"}

vLLM's factory pops `type`, `module_path` and `backpressure` and passes every other key of the
entry to the tier's constructor as a keyword; `TierConfig.parse` checks them all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

from kvnode.common import default_socket
from kvnode.plan import QUAD_S, TOKENS_PER_S, RecomputeCost, recompute_cost

#: How the daemon moves bytes between its tier and vLLM's primary (CPU) tier.
COPY_MODES = ("auto", "region", "arena")


class TierConfigError(ValueError):
    """A tier setting kvnode cannot use; the message names the key."""


@dataclass(frozen=True)
class TierConfig:
    """Every field is a key of the tier's entry in `secondary_tiers`.

    socket           daemon socket path (default: $KVNODE_SOCKET, else the daemon's default)
    model_name       model name in the namespace (default: vLLM's model)
    tenant_salt      tenant isolation, folded into the namespace id
    copy             "auto": zero copy into the primary tier's shared memory when the daemon can
                     map it, else one copy through the daemon's arena mapping; "region" or
                     "arena" force one (start fails if "region" is impossible, with the reason)
    threads          transfer threads (one daemon connection each) for loads and stores
    io_timeout_s     socket timeout of every daemon call: a frozen daemon fails the job after it
    hint_wait_s      longest a hinted lookup waits for the daemon's pull from the named peer
                     (also capped by the daemon's declared timeout); the prefix is computed after
    locality         "LOCAL" (default: the daemon is on this node) or "REMOTE", for vLLM's
                     per-request tier filter (`kv_load_tiers`)
    recompute_tokens_per_s  the engine's prefill rate at short context (tokens/s); with it set,
                     lookups send the recompute cost and take the daemon's fetch plan (chunks
                     past its cut miss: vLLM computes them). Env KVNODE_RECOMPUTE_TOKENS_PER_S
                     wins. 0 = off (default)
    recompute_quad_s the prefill's attention term, seconds per token² (env KVNODE_RECOMPUTE_QUAD_S)
    touch_gpu_hits   answer vLLM's `touch` (chunks to mark recently used, e.g. its GPU prefix
                     hits) with a kvnode `Touch`, so the daemon's DRAM policy keeps them. Default
                     true. vLLM 0.33's OffloadingConnector never calls `touch` (docs/vllm.md)
    """

    socket: str = ""
    model_name: str = ""
    tenant_salt: str = ""
    copy: str = "auto"
    threads: int = 4
    io_timeout_s: float = 10.0
    hint_wait_s: float = 5.0
    locality: str = "LOCAL"
    recompute_tokens_per_s: float = 0.0
    recompute_quad_s: float = 0.0
    touch_gpu_hits: bool = True

    def recompute(self) -> Optional[RecomputeCost]:
        """The recompute cost lookups send (the environment overriding), or None: no plans."""
        return recompute_cost({TOKENS_PER_S: self.recompute_tokens_per_s or None,
                               QUAD_S: self.recompute_quad_s})

    @classmethod
    def parse(cls, kwargs: Mapping[str, Any]) -> "TierConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise TierConfigError(f"kvnode tier: unknown secondary_tiers keys {unknown}; "
                                  f"known: {sorted(known)}")
        vals: Dict[str, Any] = {}
        for name, value in kwargs.items():
            default = known[name].default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            elif isinstance(default, float):
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and (value >= 0 if name.startswith("recompute_") else value > 0))  # 0 = off
                value = float(value) if ok else value
            else:
                ok = isinstance(value, str)
            if not ok:
                raise TierConfigError(f"kvnode tier: {name} = {value!r} is not a valid "
                                      f"{type(default).__name__} (> 0 for numbers, "
                                      f">= 0 for recompute_*)")
            vals[name] = value
        if vals.get("copy", "auto") not in COPY_MODES:
            raise TierConfigError(f"kvnode tier: copy {vals['copy']!r} is not one of {COPY_MODES}")
        if vals.get("locality", "LOCAL") not in ("LOCAL", "REMOTE"):
            raise TierConfigError(f"kvnode tier: locality {vals['locality']!r} is not LOCAL or REMOTE")
        vals.setdefault("socket", default_socket())
        return cls(**vals)
