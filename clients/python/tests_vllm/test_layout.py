"""The worker's GPU layout against vLLM 0.33's own KV allocation code, on CPU.

vLLM's `create_kv_cache_views` builds the per-layer views its attention kernels use from a
KVCacheTensor; the worker side turns the same KVCacheTensor into the daemon's GpuLayout. For
every layout and block, the bytes the daemon would copy must be exactly the bytes vLLM's views
of that block span. And the layout the connector asks vLLM for must be the one vLLM resolves.
"""

import pytest
import torch
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from conftest import vllm_config
from kvnode.vllm.config import ConfigError
from kvnode.vllm.worker_side import Placement


def span(view: torch.Tensor):
    """[first byte, last byte + 1) of a strided view inside its storage."""
    es = view.element_size()
    first = view.storage_offset() * es
    last = first + sum((n - 1) * s for n, s in zip(view.shape, view.stride())) * es + es
    return first, last


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_daemon_layout_covers_exactly_vllms_block_bytes(layout):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    layers, blocks, page = 3, 10, spec.page_size_bytes
    lay = KVCacheLayout[layout]
    if lay.is_layer_compact:
        ls, bs = page * blocks, page
    else:
        ls, bs = page, page * layers
    t = KVCacheTensor(size=page * blocks * layers, layers=[f"l{i}" for i in range(layers)],
                      layer_stride=ls, block_stride=bs)
    raw = torch.zeros(t.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, lay, t)
    gl = Placement(0, ls, bs, layers, page, blocks).layout(0)
    gl.validate(t.size)
    for b in range(blocks):
        ours = sorted((gl.base + b * gl.page_stride + o.offset, gl.base + b * gl.page_stride + o.offset + o.size)
                      for o in gl.objects)
        theirs = sorted(span(views[l][b]) for l in range(layers))
        if len(ours) == 1:  # block-outermost: one run covering every layer's page
            assert ours == [(theirs[0][0], theirs[-1][1])]
            assert all(theirs[i][1] == theirs[i + 1][0] for i in range(layers - 1))
        else:
            assert ours == theirs, f"{layout} block {b}"
        assert sum(e - s for s, e in ours) == layers * page


def test_vllm_resolves_the_layout_the_connector_asks_for(model_dir, tmp_path):
    default_pref = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]
    vc = vllm_config(model_dir, str(tmp_path / "s.sock"))
    vc.cache_config.kv_cache_layout = None
    assert resolve_kv_cache_layout(vc, default_pref) == KVCacheLayout.BLNHC
    vc = vllm_config(model_dir, str(tmp_path / "s.sock"), kv_cache_layout="")
    vc.cache_config.kv_cache_layout = None
    assert resolve_kv_cache_layout(vc, default_pref) == KVCacheLayout.LBNHC
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        vc = vllm_config(model_dir, str(tmp_path / "s.sock"), kv_cache_layout="XYZ")
        vc.cache_config.kv_cache_layout = None
        resolve_kv_cache_layout(vc, default_pref)
