"""Layouts the kvnode tier accepts and the ones it refuses, and its settings checked at start.

Accepted: hybrid (HMA) KV cache configs; each KV cache group is its own kvnode segment, and a
sliding-window group's keys are answered one by one past a gap (suffix lookups). Refused at
start, with the reason: a chunk row larger than the daemon's slab, unknown or mistyped settings,
and a forced zero copy where the primary tier is not shared memory."""

import time

import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor, SlidingWindowSpec)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from conftest import BLOCK, HEAD, KV_HEADS
from kvnode.vllm_tier.config import TierConfig, TierConfigError
from kvnode.vllm_tier.namespace import UnsupportedLayout
from tier_env import Engine, keys_and_rows


def hybrid_kv_cache_config(num_blocks: int = 64) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                            dtype=torch.float16, sliding_window=2 * BLOCK)
    l0, l1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
    page = full.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * 2, layers=[l0, l1],
                                        layer_stride=page * num_blocks, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec([l0], full), KVCacheGroupSpec([l1], swa)])


def _decided(e, keys, ctx, limit_s: float = 10.0):
    """Each key looked up in the same steps (one batch per step, as the scheduler's sliding-window
    scan issues them), until every answer is a final HIT or MISS. Bounded by time, not by a
    count of steps: the daemon's answers arrive on its own schedule, slower on a loaded machine."""
    t0 = time.monotonic()
    while True:
        with e.m.lock:
            res = [e.m.lookup(k, ctx) for k in keys]
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
            return res
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"lookups not decided in {limit_s}s: {res}")
        e.step()
        time.sleep(0.002)


def test_a_hybrid_layout_stores_each_group_as_its_own_segment(daemon, model_dir):
    e = Engine(model_dir, daemon.socket, chunks=8, kcc=hybrid_kv_cache_config())
    try:
        groups = [g.group_id for g in e.tier._config.groups]
        assert groups == [0, 1], groups
        assert e.tier._namespace()["segments"] == [e.tier.block_size_bytes] * 2
        k0, r0, h = keys_and_rows(3, group=0)
        k1 = [make_offload_key(x, 1) for x in h]  # the same blocks' sliding-window group
        r1 = keys_and_rows(3)[1]
        e.store(k0, r0)
        e.store(k1[1:], r1[1:])  # window group: block 0 fell out of the window, never stored
        filler, frows, _ = keys_and_rows(8)
        e.store(filler, frows)
        ctx = ReqContext(req_id="hma")
        with e.m.lock:
            e.m.on_new_request(ctx)
        assert e.lookup(k0, ctx)[0] == 3
        assert e.read_loaded(k0, ctx) == r0
        assert _decided(e, k1, ctx) == [LookupResult.MISS, LookupResult.HIT, LookupResult.HIT], \
            "a window group's keys after a gap are still found"
        assert e.read_loaded(k1[1:], ctx) == r1[1:]
    finally:
        e.close()


def test_a_chunk_larger_than_the_daemons_slab_is_refused_at_start_with_the_reason(daemon, model_dir):
    # 1100 blocks of 4 KiB per chunk: 4.4 MB rows, over the test daemon's 4 MiB slab.
    with pytest.raises(UnsupportedLayout, match="refuses rows of 4505600 bytes"):
        Engine(model_dir, daemon.socket, chunks=2, extra={"blocks_per_chunk": 1100})


def test_settings_are_checked_with_the_key_named():
    with pytest.raises(TierConfigError, match="unknown secondary_tiers keys"):
        TierConfig.parse({"sockett": "/x"})
    with pytest.raises(TierConfigError, match="copy 'zero'"):
        TierConfig.parse({"copy": "zero"})
    with pytest.raises(TierConfigError, match="threads"):
        TierConfig.parse({"threads": 0})
    assert TierConfig.parse({"socket": "/s", "io_timeout_s": 1}).io_timeout_s == 1.0


def test_forced_zero_copy_needs_a_shared_file_under_the_primary_tier(daemon):
    from kvnode.vllm_tier.primary import shared_extents, view_base
    anon = bytearray(1 << 16)
    extents, why = shared_extents(view_base(memoryview(anon)), len(anon))
    assert extents == [] and "not a named shared file" in why
