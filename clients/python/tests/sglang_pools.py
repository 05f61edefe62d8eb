"""SGLang 0.5.23's own host pools on CPU (MHATokenToKVPoolHost, MambaPoolHost), for the tests.

The pools are SGLang's classes, built from a CPU description of their device buffers (the
device side is only read by L1<->L2 transfers, which these tests do not run); with
`shm=True` they allocate through SGLang's ShmHostTensorAllocator (`"allocator": "shm"`).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

CPU = torch.device("cpu")


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout: str = "page_first", pages: int = 16, page_size: int = 4, layer_num: int = 3,
             head_num: int = 2, head_dim: int = 64, dtype=torch.bfloat16, shm: bool = True,
             pool_label: str = "kv") -> MHATokenToKVPoolHost:
    dev_tokens = page_size * 2
    k = tuple(torch.zeros((dev_tokens, head_num, head_dim), dtype=dtype) for _ in range(layer_num))
    v = tuple(torch.zeros((dev_tokens, head_num, head_dim), dtype=dtype) for _ in range(layer_num))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=_nhd()),
        page_size=page_size, head_num=head_num, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=CPU)
    pool = MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", allocator_type="shm" if shm else "default",
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layer_num - 1,
        pool_label=pool_label, host_token_capacity=pages * page_size)
    pool._keep = (k, v)  # the "device" buffers the pool's pointer tables name
    return pool


def _nhd():
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout

    return next(iter(KVBufferLayout))


def indices(pool, pages):
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def raw(pool) -> torch.Tensor:
    """Every byte of the pool's host buffers as one uint8 view per buffer."""
    return pool.kv_buffer.view(-1).view(torch.uint8)


def page_bytes(pool, page: int) -> bytes:
    """Every byte of one page, object by object, as the daemon sees them."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(indices(pool, [page]))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    r = raw(pool)
    r.copy_(torch.randint(0, 256, r.shape, generator=g, dtype=torch.uint8))


def mamba_pool(slots: int = 16, layers: int = 2, shm: bool = True, temporal=(4, 8), conv=((3, 16),),
               dtype=torch.float32):
    """SGLang's MambaPoolHost (page size 1: one state slot per page), with separately
    allocated temporal and conv buffers (one memfd each under the shm allocator)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    dev = 4
    info = MambaStateBufferInfo(
        temporal=torch.zeros((layers, dev, *temporal), dtype=dtype),
        conv=tuple(torch.zeros((layers, dev, *c), dtype=dtype) for c in conv))
    pool = MambaPoolHost(info, host_to_device_ratio=slots / dev, host_size=0, device_capacity=dev,
                         pin_memory=False, device="cpu", allocator_type="shm" if shm else "default",
                         layout="page_first")
    pool._keep = info
    return pool


def mamba_raw(pool):
    return [pool.temporal_buffer.view(-1).view(torch.uint8)] + [
        b.view(-1).view(torch.uint8) for b in pool.conv_buffer]


def mamba_fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for r in mamba_raw(pool):
        r.copy_(torch.randint(0, 256, r.shape, generator=g, dtype=torch.uint8))


def mla_pool(layout: str = "page_first", pages: int = 16, page_size: int = 4, layer_num: int = 3,
             kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, dtype=torch.bfloat16, shm: bool = True):
    """SGLang's MLATokenToKVPoolHost (one latent row per token and layer, replicated across TP)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dim = kv_lora_rank + qk_rope_head_dim
    bufs = tuple(torch.zeros((page_size * 2, 1, dim), dtype=dtype) for _ in range(layer_num))
    info = MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layer_num)),
                         device_layer_num=layer_num, page_size=page_size, kv_lora_rank=kv_lora_rank,
                         qk_rope_head_dim=qk_rope_head_dim, kv_cache_dim=dim, dtype=dtype, device=CPU)
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
        allocator_type="shm" if shm else "default", device_capacity_tokens=page_size * 2,
        start_layer=0, end_layer=layer_num - 1, target_layer_num=layer_num,
        host_token_capacity=pages * page_size)
    pool._keep = bufs
    return pool
