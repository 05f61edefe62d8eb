"""The kvnode namespace and keys of vLLM's offloaded chunks (no vllm import).

A vLLM `OffloadKey` is `block_hash || group_idx (u32 BE)`. The tier stores the chunk as the
kvnode key `[digest_of(block_hash), group_idx]`: the digest is the connector's (`hash[-8:] ||
hash[:24]` for 32-byte hashes), so the router hash that vLLM and Dynamo use for a block (its
last 8 bytes, big-endian) is the digest's first 8 bytes, which is what the daemon's peer path
matches hints against. One segment per KV cache group, each one primary-tier row long.

Everything that changes a row's bytes or its hash is in the namespace: model, KV dtype, tokens
per block and per hash, blocks per chunk, the row length, the worker KV bytes per block, the KV
cache layout (and canonical / replicated layouts), every group's block size, sliding window and
layer names, the parallel sizes (dropped when vLLM certifies the rows parallelism-agnostic, as
its fs tier does), and a digest of vLLM's `NONE_HASH` (the chain seed: it covers the hash
algorithm and `PYTHONHASHSEED`; only a SHA-256 of it leaves the process, so a secret xxhash
seed stays secret). A scheduler-side row holds every worker's share of a chunk, so one
namespace covers all TP ranks of an engine.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence

from kvnode.common import MAX_SEGMENTS, NamespaceSpec
from kvnode.vllm.keys import digest_of


class UnsupportedLayout(ValueError):
    """A vLLM offloading configuration the tier cannot address; the message says why."""


def split_key(key: bytes) -> tuple:
    """(block hash, group index) of a vLLM OffloadKey."""
    k = bytes(key)
    if len(k) < 12:
        raise ValueError(f"OffloadKey of {len(k)} bytes; expected a block hash and a group index")
    return k[:-4], int.from_bytes(k[-4:], "big")


def wire_key(key: bytes) -> list:
    """The kvnode protocol key of one OffloadKey."""
    h, g = split_key(key)
    return [digest_of(h), g]


def seed_tag(none_hash: Optional[bytes]) -> str:
    """A public tag of vLLM's chain seed (NONE_HASH): equal seeds give equal tags."""
    if none_hash is None:
        raise UnsupportedLayout("vLLM's NONE_HASH is not initialised yet (init_none_hash has not "
                                "run): block hashes cannot be named")
    return hashlib.sha256(b"kvnode-vllm-none-hash\0" + bytes(none_hash)).hexdigest()[:32]


def group_ids(config: Any) -> List[int]:
    return [int(g.group_id) for g in config.groups]


def check_layout(config: Any, row_bytes: int) -> int:
    """Number of segments (KV cache groups) the namespace needs; refuses what cannot be stored."""
    ids = group_ids(config)
    if not ids:
        raise UnsupportedLayout("the offloading config has no KV cache group to offload")
    nseg = max(ids) + 1
    if nseg > MAX_SEGMENTS:
        raise UnsupportedLayout(f"{nseg} KV cache groups; a kvnode namespace holds at most "
                                f"{MAX_SEGMENTS} segments")
    if row_bytes <= 0:
        raise UnsupportedLayout(f"primary-tier rows of {row_bytes} bytes")
    if int(config.cache.blocks_per_chunk) < 1:
        raise UnsupportedLayout(f"blocks_per_chunk {config.cache.blocks_per_chunk}")
    return nseg


def namespace_spec(config: Any, row_bytes: int, none_hash: Optional[bytes], model_name: str = "",
                   tenant_salt: str = "") -> Dict[str, Any]:
    """A `NamespaceSpec` (kvnode.common) for one engine's offloaded chunks, as its wire map."""
    nseg = check_layout(config, row_bytes)
    par = config.parallel
    agnostic = bool(par.is_parallelism_agnostic)
    groups = [{"id": int(g.group_id), "tokens_per_block": int(g.tokens_per_block),
               "window_chunks": g.sliding_window_size_in_chunks,
               "layers": list(g.layer_names)} for g in config.groups]
    ident = json.dumps({"groups": groups, "layout": config.kv_cache_layout,
                        "canonical": bool(config.canonical_layout),
                        "replicated": bool(config.replicated_layout),
                        "pcp": 1 if agnostic else int(par.pcp_size),
                        "dcp": 1 if agnostic else int(par.dcp_size),
                        "world": 1 if agnostic else int(par.world_size)},
                       sort_keys=True, separators=(",", ":"))
    shape_tag = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return NamespaceSpec(
        model=model_name or str(config.model.name),
        dtype=str(config.model.dtype),
        page_size=int(config.groups[0].tokens_per_block) * int(config.cache.blocks_per_chunk),
        layout=f"vllm-tier:{config.kv_cache_layout or 'default'}:{shape_tag}:seed={seed_tag(none_hash)}",
        kv_shape=(int(config.cache.tokens_per_hash), int(config.cache.blocks_per_chunk),
                  int(config.worker_kv_bytes_per_block), int(row_bytes), nseg),
        tp_rank=0,
        tp_size=1 if agnostic else max(1, int(par.tp_size)),
        pp_rank=0,
        pp_size=1 if agnostic else max(1, int(par.pp_size)),
        cp_rank=0,
        cp_size=1,
        mla=False,
        tenant_salt=tenant_salt,
        segments=(int(row_bytes),) * nseg,
    ).to_wire()


def keys_of(keys: Sequence[bytes]) -> List[list]:
    return [wire_key(k) for k in keys]
