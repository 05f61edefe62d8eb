"""The kvnode namespace of an SGLang rank: every config and host-pool fact that changes a page's bytes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from kvnode.common import NamespaceSpec


def _int(obj: Any, name: str, default: int = 0) -> int:
    v = getattr(obj, name, default)
    return default if v is None else int(v)


def namespace_spec(config: Any, host_pool: Any, segments: List[int], flavor: str = "",
                   pool: str = "", replicated: Optional[bool] = None) -> Dict[str, Any]:
    """A `NamespaceSpec` (kvnode.common) as its msgpack-ready wire map.

    `segments` are the byte sizes of one page's objects (K and V, or one per layer and K/V
    for layer_first, or one for MLA). `flavor` separates byte arrangements that share a
    layout name (the legacy flat-page path uses "flat"). `pool` names an SGLang host pool
    other than the KV anchor (v2 API: mamba, swa, indexer, draft, ...): each pool gets its
    own namespace, so pools never alias. `replicated` overrides the config's MLA flag for
    pools whose bytes are per TP rank even in an MLA model (Mamba state). TP coordinates are folded in
    unless the model is MLA (every TP rank holds the same bytes; the daemon drops them);
    PP stage, attention CP and DCP coordinates, split-heads geometry, model, dtype, page
    size and layout always are, so ranks holding different slices never share a key.
    dp_rank is left out on purpose: DP replicas with equal attention coordinates hold
    identical bytes, and sharing them is the point of a node-level cache.
    """
    extra = getattr(config, "extra_config", None) or {}
    tp_size = max(1, _int(config, "tp_size", 1))
    tp_rank = _int(config, "tp_rank", 0)
    head_num = _int(host_pool, "head_num", 0)
    split = bool(getattr(config, "should_split_heads", False))
    layout = str(getattr(host_pool, "layout", "page_first"))
    if flavor:
        layout = f"{layout}+{flavor}"
    if pool:
        layout = f"{layout}+pool={pool}"
    shape = [
        _int(host_pool, "layer_num", 0),
        head_num,
        _int(host_pool, "head_dim", 0),
        _int(host_pool, "kv_lora_rank", 0),
        _int(host_pool, "qk_rope_head_dim", 0),
        _int(config, "tp_lcm_size", 0),
        int(split),
        _int(config, "dcp_rank", 0),
        max(1, _int(config, "dcp_size", 1)),
        _int(host_pool, "start_layer", 0),
    ]
    mla = bool(getattr(config, "is_mla_model", False)) if replicated is None else replicated
    return NamespaceSpec(
        model=str(getattr(config, "model_name", None) or ""),
        dtype=str(getattr(host_pool, "dtype", "")),
        page_size=_int(host_pool, "page_size", 1) or 1,
        layout=layout,
        kv_shape=tuple(shape),
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=_int(config, "pp_rank", 0),
        pp_size=max(1, _int(config, "pp_size", 1)),
        cp_rank=_int(config, "attn_cp_rank", 0),
        cp_size=max(1, _int(config, "attn_cp_size", 1)),
        head_range=None if mla or not head_num else (tp_rank * head_num, (tp_rank + 1) * head_num),
        mla=mla,
        tenant_salt=str(extra.get("tenant_salt", "")),
        segments=tuple(int(s) for s in segments),
    ).to_wire()


def digest_of(key: str) -> bytes:
    """SGLang's page key (64 hex chars of the chained SHA-256) as the 32-byte digest."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    raise ValueError(
        f"HiCache key {key[:80]!r} is not a 64-hex-char page hash; kvnode stores SGLang's "
        "KV page hashes only (v1 interface)"
    )
