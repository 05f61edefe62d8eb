"""vLLM block hashes -> kvnode keys, and the kvnode namespace of a vLLM rank (no vllm import).

A vLLM block hash is the chained hash of the block's tokens (and, on the first block, the
request's `cache_salt`, LoRA and multimodal extra keys) under the deployment's
`--prefix-caching-hash-algo`. The router hash that vLLM publishes in KV events, and that comes
back in Dynamo `kv.fetch` hints, is `int.from_bytes(hash, "big") & (2**64 - 1)`: the hash's
LAST 8 bytes read big-endian. kvnode's peer protocol matches a hint's u64 against the FIRST 8
bytes of a key's digest, big-endian. So the 32-byte kvnode digest is

    digest = hash[-8:] || hash[:24]                    (32-byte hashes: sha256, sha256_cbor)
    digest = hash[-8:] || SHA-256(hash)[:24]           (any other length)

a bijection for 32-byte hashes, and the router hash reads straight off the digest. Everything
else that changes a block's bytes or its hash lives in the namespace: model, KV dtype, block
size, layout, the hash algorithm, TP/PP/DCP coordinates and the per-segment slot sizes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvnode.common import NamespaceSpec

_U64 = (1 << 64) - 1


def digest_of(block_hash: bytes) -> bytes:
    """The kvnode page digest of one vLLM block hash (see the module docs)."""
    h = bytes(block_hash)
    if len(h) < 8:
        raise ValueError(f"vLLM block hash of {len(h)} bytes; expected at least 8")
    tail = h[-8:]
    if len(h) == 32:
        return tail + h[:24]
    return tail + hashlib.sha256(h).digest()[:24]


def router_hash(block_hash: bytes) -> int:
    """vLLM's external (KV-event) u64 hash of a block: its last 8 bytes, big-endian."""
    return int.from_bytes(bytes(block_hash), "big") & _U64


def block_hashes_per_block(hashes: Sequence[bytes], block_size: int, hash_block_size: int) -> List[bytes]:
    """One hash per KV block. vLLM may hash at a finer granularity (`hash_block_size`) than
    its KV blocks; block i is then named by the last sub-hash inside it (hashes are chained,
    so that one hash identifies the whole prefix)."""
    if hash_block_size <= 0 or block_size % hash_block_size:
        raise ValueError(f"block_size {block_size} is not a multiple of hash_block_size {hash_block_size}")
    r = block_size // hash_block_size
    if r == 1:
        return list(hashes)
    return [hashes[(i + 1) * r - 1] for i in range(len(hashes) // r)]


@dataclass(frozen=True)
class Segment:
    """One kvnode segment of a block: a run of `layers` layer pages of `page_bytes` each
    (one vLLM KVCacheTensor). Its slot size is layers * page_bytes."""

    layers: int
    page_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page_bytes


@dataclass(frozen=True)
class RankGeometry:
    """Every fact of a vLLM rank that changes a block's bytes or its key (plain values)."""

    model: str
    dtype: str
    block_size: int
    layout: str
    hash_algo: str
    num_kv_heads: int
    head_size: int
    num_layers: int
    segments: Tuple[Segment, ...]
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    mla: bool = False
    tenant_salt: str = ""

    def namespace_spec(self) -> Dict[str, Any]:
        """A `NamespaceSpec` (kvnode.common) as its msgpack-ready wire map.

        The layout name is prefixed `vllm:` and carries the hash algorithm, so SGLang pages and
        vLLM blocks of the same model never share a namespace, nor do two hash algorithms.
        """
        if not self.segments or any(s.block_bytes <= 0 for s in self.segments):
            raise ValueError(f"namespace needs non-empty segments, got {self.segments}")
        return NamespaceSpec(
            model=self.model,
            dtype=self.dtype,
            page_size=int(self.block_size),
            layout=f"vllm:{self.layout}:{self.hash_algo}",
            kv_shape=(self.num_layers, self.num_kv_heads, self.head_size, self.dcp_rank,
                      max(1, self.dcp_size), *(v for s in self.segments for v in (s.layers, s.page_bytes))),
            tp_rank=int(self.tp_rank),
            tp_size=max(1, int(self.tp_size)),
            pp_rank=int(self.pp_rank),
            pp_size=max(1, int(self.pp_size)),
            cp_rank=0,
            cp_size=1,
            mla=bool(self.mla),
            tenant_salt=self.tenant_salt,
            segments=tuple(s.block_bytes for s in self.segments),
        ).to_wire()


def keys_of(digests: Sequence[bytes], nseg: int) -> List[list]:
    """Protocol keys for whole blocks: every segment of block 0, then of block 1, ..."""
    return [[d, s] for d in digests for s in range(nseg)]


def leading_blocks(leading_keys: int, nseg: int) -> int:
    """Whole blocks in a leading run of `leading_keys` keys of `keys_of(..., nseg)`."""
    return leading_keys // nseg


def hint_covers(hint: Optional[dict], block_hashes: Sequence[bytes]) -> bool:
    """Whether a normalized hint (kvnode.hints.extract_router_hint) names this request's first
    block, i.e. the daemon would be able to match it (peer-protocol.md, hint checks)."""
    if not hint or not block_hashes:
        return False
    return router_hash(block_hashes[0]) in set(hint["block_hashes"])
