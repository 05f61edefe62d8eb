"""The decoder over the paged pool, the GPU prefix cache, and the pool's block bytes (CPU, tiny config)."""

import pytest
import torch

from harness import model as m
from harness import pool as pl


def _prompt(n, seed=0):
    return torch.randint(0, m.TINY.vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", pl.LAYOUTS)
def a_cached_prefix_read_back_from_pages_gives_the_same_logits_as_one_pass(layout):
    dec = m.Decoder(m.TINY, "cpu", seed=1, dtype=torch.float32)
    toks = _prompt(70)
    ps = m.TINY.page_size
    one = pl.KvPool(m.TINY, 8, "cpu", layout, torch.float32)
    full = dec.prefill(toks, 0, torch.arange(5), one)
    two = pl.KvPool(m.TINY, 8, "cpu", layout, torch.float32)
    pages = torch.tensor([7, 2, 5, 0, 3])  # scattered page ids
    dec.prefill(toks[:3 * ps], 0, pages, two)
    split = dec.prefill(toks[3 * ps:], 3 * ps, pages, two)
    assert torch.allclose(full, split, atol=1e-4, rtol=1e-4)
    assert int(full.argmax()) == int(split.argmax())


def a_prefix_that_is_not_whole_pages_is_refused():
    dec = m.Decoder(m.TINY, "cpu")
    with pytest.raises(ValueError, match="whole"):
        dec.prefill(_prompt(4), 5, torch.arange(2), pl.KvPool(m.TINY, 2, "cpu"))


def both_layouts_store_the_same_block_bytes_for_the_same_kv():
    dec = m.Decoder(m.TINY, "cpu", seed=2)
    a, b = pl.KvPool(m.TINY, 4, "cpu", "layer_first"), pl.KvPool(m.TINY, 4, "cpu", "page_first")
    toks = _prompt(40, 3)
    dec.prefill(toks, 0, torch.arange(3), a)
    dec.prefill(toks, 0, torch.arange(3), b)
    for p in range(3):
        assert a.read_block(p) == b.read_block(p)
        assert len(a.read_block(p)) == m.TINY.page_bytes
    c = pl.KvPool(m.TINY, 4, "cpu", "layer_first")
    c.write_block(1, a.read_block(2))
    assert c.read_block(1) == a.read_block(2)


def qwen3_8b_shapes_and_page_arithmetic():
    c = m.QWEN3_8B
    assert (c.layers, c.hidden, c.q_heads, c.kv_heads, c.head_dim, c.page_size) == (36, 4096, 32, 8, 128, 64)
    assert c.kv_bytes_per_token == 147456 and c.page_bytes == 9 * 2 ** 20
    assert 8.0e9 < c.params < 8.4e9


def the_daemon_layout_of_each_pool_matches_its_memory():
    for layout in pl.LAYOUTS:
        p = pl.KvPool(m.TINY, 6, "cpu", layout)
        gl = p.gpu_layout(0)
        gl.validate(p.t.numel() * 2)
        assert gl.page_bytes == m.TINY.page_bytes
        # Object j of page 4 starts where (layer j//2, K|V j%2) of page 4 starts in the tensor.
        flat = p.t.view(-1)
        for j, o in enumerate(gl.objects):
            off = (4 * gl.page_stride + o.offset) // 2
            view = p.k(j // 2) if j % 2 == 0 else p.v(j // 2)
            assert view[4].data_ptr() == flat[off:].data_ptr()


def the_prefix_cache_matches_leading_pages_and_never_evicts_pinned_ones():
    c = pl.PrefixCache(4)
    pages = c.alloc(3)
    for d, p in zip((b"a", b"b", b"c"), pages):
        c.insert(d, p)
    assert c.match([b"a", b"b", b"x", b"c"]) == pages[:2]
    c.unpin(pages[1:])  # page of b"a" stays pinned
    got = c.alloc(3)  # one free page + evicts b"b" and b"c" (LRU order), never b"a"
    assert pages[0] not in got and len(set(got)) == 3
    assert c.match([b"a"]) == [pages[0]] and c.match([b"b"]) == []
    with pytest.raises(pl.PoolFull):
        c.alloc(1)
    c.release(got)
    assert len(c.alloc(3)) == 3
