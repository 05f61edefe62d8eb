"""The engine-like decode step (harness/decode.py, harness/paged_attn.py) on the CPU."""

import pytest
import torch

from harness import batched, decode, paged_attn
from harness import model as m
from harness import pool as pl


def _prefilled(layout="layer_first", lens=(40, 23, 57, 16), pages_per=6):
    dec = m.Decoder(m.TINY, "cpu", seed=3, dtype=torch.float32)
    pool = pl.KvPool(m.TINY, 32, "cpu", layout, torch.float32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, m.TINY.vocab, (n,), generator=g) for n in lens]
    # Scattered, non-consecutive page ids per sequence (a block table, not a range).
    perm = torch.randperm(32, generator=g)
    pages = [perm[i * pages_per:(i + 1) * pages_per] for i in range(len(lens))]
    out = batched.forward(dec, [batched.Seq(p, 0, pg) for p, pg in zip(prompts, pages)], pool)
    return dec, pool, prompts, pages, out.argmax(-1)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def a_graph_decoder_step_gives_the_logits_of_the_per_sequence_decode(layout):
    dec, pool, prompts, pages, nxt = _prefilled(layout)
    ref_pool = pool.t.clone()
    ref = batched.forward(dec, [batched.Seq(nxt[i:i + 1], len(p), pg)
                                for i, (p, pg) in enumerate(zip(prompts, pages))], pool)
    written = pool.t.clone()
    pool.t.copy_(ref_pool)
    gd = decode.GraphDecoder(dec, pool, max_pages=8, max_batch=4)
    assert (gd.attn, gd.graphs) == ("sdpa", False)
    # Three of the four sequences: padded to the 4-bucket by repeating row 0.
    seqs = [decode.DecodeSeq(int(nxt[i]), len(p), pg.tolist()) for i, (p, pg) in enumerate(zip(prompts, pages))]
    toks = gd.step(seqs[:3])
    bk = gd.bucket_for(3)
    assert bk.size == 4
    for i in range(3):
        assert torch.allclose(bk.logits[i].float(), ref[i], atol=1e-4, rtol=1e-4), i
    assert toks == ref[:3].argmax(-1).tolist()
    # The new tokens' K/V went to the same slots as the per-sequence path wrote.
    wpool = pl.KvPool(m.TINY, 32, "cpu", layout, torch.float32)
    wpool.t = written
    for i in range(3):
        pg, pos = pages[i][len(prompts[i]) // 16], len(prompts[i]) % 16
        for li in range(m.TINY.layers):
            assert torch.allclose(pool.k(li)[pg, pos], wpool.k(li)[pg, pos], atol=1e-5)
            assert torch.allclose(pool.v(li)[pg, pos], wpool.v(li)[pg, pos], atol=1e-5)
    with pytest.raises(ValueError, match="needs"):
        gd.step([decode.DecodeSeq(1, 8 * 16, list(range(9)))])
    with pytest.raises(ValueError, match="bucket"):
        gd.step(seqs + seqs)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def the_split_k_kernel_matches_the_sdpa_reference(layout):
    if paged_attn.triton is None:
        pytest.fail("triton is not installed: the test venv (scripts/locks/sglang.lock) has it")
    torch.manual_seed(0)
    cfg = m.ModelConfig("gqa4", 2, 64, 8, 2, 32, 64, 64, page_size=16)
    pool = pl.KvPool(cfg, 24, "cpu", layout, torch.float32)
    pool.t.normal_()
    ctx = torch.tensor([1, 16, 17, 70], dtype=torch.int32)
    bt = torch.stack([torch.randperm(24)[:6] for _ in range(4)]).to(torch.int32)
    q = torch.randn(4, 8, 32)
    ref = paged_attn.sdpa_reference(q, pool.k(1), pool.v(1), bt, ctx)
    for splits in (1, 3, 8):  # 8 splits of a 1-page sequence: empty splits must not poison it
        out = paged_attn.triton_decode(q, pool.k(1), pool.v(1), bt, ctx, splits)
        assert torch.allclose(out, ref, atol=2e-3, rtol=2e-3), (splits, (out - ref).abs().max())
    # A page past ctx holding garbage changes nothing.
    pool.k(1)[bt[0, 1]] = 1e4
    out = paged_attn.triton_decode(q, pool.k(1), pool.v(1), bt, ctx, 2)
    assert torch.allclose(out[0], ref[0], atol=2e-3, rtol=2e-3)


def the_fused_kernels_compute_the_unfused_step():
    """harness/fused.py (Triton, here in its CPU interpreter) against the torch ops it replaces,
    bf16 as on the GPU: same K/V in the pool slots, same logits up to bf16 rounding."""
    if paged_attn.triton is None:
        pytest.fail("triton is not installed: the test venv (scripts/locks/sglang.lock) has it")
    dec = m.Decoder(m.TINY, "cpu", seed=3)  # bf16
    for L in dec.layers:  # non-trivial norm weights
        for key in ("ln1", "ln2", "qn", "kn"):
            L[key] = (1 + 0.1 * torch.randn(L[key].shape)).to(torch.bfloat16)
    pool = pl.KvPool(m.TINY, 32, "cpu")
    pool.t.normal_()
    seqs = [decode.DecodeSeq(7, 37, [3, 9, 4]), decode.DecodeSeq(11, 5, [20]), decode.DecodeSeq(2, 16, [8, 1])]
    ref = decode.GraphDecoder(dec, pool, 4, 4)
    before = pool.t.clone()
    ref.step(seqs)
    want, want_kv = ref.bucket_for(3).logits.float().clone(), pool.t.clone()
    pool.t.copy_(before)
    fz = decode.GraphDecoder(dec, pool, 4, 4, fused=True)
    fz.step(seqs)
    got = fz.bucket_for(3).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert torch.equal(got[:3].argmax(-1), want[:3].argmax(-1))
    changed = (want_kv != before).any(dim=-1)  # the slots the step wrote (K and V, every layer)
    assert changed.sum() > 0
    diff = (pool.t.float() - want_kv.float()).abs()
    assert diff.max().item() < 0.1 and (pool.t != before).any(dim=-1).equal(changed)
