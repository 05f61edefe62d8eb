"""`kv_connector_extra_config` of the kvnode vLLM connector, checked (no vllm import)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

from kvnode.common import default_socket
from kvnode.plan import QUAD_S, TOKENS_PER_S, RecomputeCost, recompute_cost

#: vLLM 0.33's KVCacheLayout names (and "" = no preference).
_LAYOUTS = {"", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "NHD", "HND"}


class ConfigError(ValueError):
    """A `kv_connector_extra_config` entry kvnode cannot use; the message names it."""


@dataclass(frozen=True)
class KvnodeVllmConfig:
    """Connector settings. Every field is a key of `kv_connector_extra_config`.

    socket             daemon socket path
    model_name         namespace model name (default: vLLM's --model / served model)
    tenant_salt        tenant isolation: folded into the namespace id
    lookup_wait_ms     how long get_num_new_matched_tokens may wait for a daemon answer
                       before returning None ("ask again next step"); 0 = never wait
    hint_wait_s        most a hinted pull may keep a request waiting (capped again by the
                       daemon's declared timeouts); after it the request runs with what is local
    load_timeout_s     most a worker waits for one step's onload before cancelling it; cancelled
                       blocks are reported as load errors (vLLM recomputes them)
    save               offload new full blocks (kv_role kv_both / kv_producer)
    load               onload hits (kv_role kv_both / kv_consumer)
    connect_timeout_s  socket timeout of every daemon call
    kv_cache_layout    the KV cache layout the connector asks vLLM for (get_required_kvcache_layout):
                       "BLNHC" (default: block-outermost, each block one contiguous run of all its
                       layers, one DMA per block), any other vLLM layout name, or "" for vLLM's
                       own choice (LBNHC by default: one DMA per layer per block, slower)
    layerwise_load     onload layer by layer: the daemon copies layer 0 of every block first,
                       start_load_kv returns once the copies are issued, and
                       wait_for_layer_load(layer) waits only for that layer, so the forward pass
                       starts when layer 0 landed. Default false (every onload completes in
                       start_load_kv): it relies on vLLM calling wait_for_layer_load before each
                       layer's attention, which a fully captured CUDA graph does not do
    recompute_tokens_per_s  the engine's prefill rate at short context (tokens/s); with it set,
                       lookups send the recompute cost and take the daemon's fetch plan
                       (kvnode.plan; env KVNODE_RECOMPUTE_TOKENS_PER_S wins). 0 = off (default)
    recompute_quad_s   the prefill's attention term, seconds per token² (env KVNODE_RECOMPUTE_QUAD_S)
    touch_gpu_hits     touch (kvnode `Touch`) the blocks vLLM's own prefix cache already holds,
                       [0, num_computed_tokens) at the lookup, so the daemon's DRAM policy keeps
                       the hottest prefixes it never serves (kvnode.touch). Default true
    """

    socket: str = ""
    model_name: str = ""
    tenant_salt: str = ""
    lookup_wait_ms: float = 2.0
    hint_wait_s: float = 5.0
    load_timeout_s: float = 10.0
    save: bool = True
    load: bool = True
    connect_timeout_s: float = 30.0
    kv_cache_layout: str = "BLNHC"
    layerwise_load: bool = False
    recompute_tokens_per_s: float = 0.0
    recompute_quad_s: float = 0.0
    touch_gpu_hits: bool = True

    def recompute(self) -> Optional["RecomputeCost"]:
        """The recompute cost lookups send (the environment overriding), or None: no plans."""
        return recompute_cost({TOKENS_PER_S: self.recompute_tokens_per_s or None,
                               QUAD_S: self.recompute_quad_s})

    @classmethod
    def parse(cls, extra: Optional[Mapping[str, Any]], kv_role: str = "kv_both") -> "KvnodeVllmConfig":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"kvnode connector: unknown kv_connector_extra_config keys {unknown}; "
                              f"known: {sorted(known)}")
        vals: Dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"kvnode connector: {name} must be true or false, got {value!r}")
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigError(f"kvnode connector: {name} must be a number >= 0, got {value!r}")
                value = float(value)
            elif not isinstance(value, str):
                raise ConfigError(f"kvnode connector: {name} must be a string, got {value!r}")
            vals[name] = value
        layout = vals.get("kv_cache_layout", "BLNHC")
        if layout not in _LAYOUTS:
            raise ConfigError(f"kvnode connector: kv_cache_layout {layout!r} is not one of {sorted(_LAYOUTS)}")
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ConfigError(f"kvnode connector: kv_role {kv_role!r} is not kv_both, kv_producer or kv_consumer")
        if kv_role == "kv_producer":
            vals.setdefault("load", False)
        if kv_role == "kv_consumer":
            vals.setdefault("save", False)
        vals.setdefault("socket", default_socket())
        return cls(**vals)
