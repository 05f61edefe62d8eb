"""One forward pass over several sequences at once: what a serving engine's batched step does.

Each sequence brings new tokens after `cached` tokens whose KV is in the pool (any count, so a
decode step is a batch of one-token sequences). The linear layers (QKV, output projection,
MLP, LM head) run once over all new tokens concatenated; attention runs per sequence over its
own pages (the eager decoder has no varlen attention kernel: that is "where the decoder
allows"). New tokens' K/V are written into their pages first, as in `Decoder.prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .model import Decoder, _rms


@dataclass
class Seq:
    tokens: torch.Tensor   # new token ids (long, CPU)
    cached: int            # tokens before them whose KV is in the pool
    pages: torch.Tensor    # page ids covering tokens 0 .. cached + len(tokens)


@torch.inference_mode()
def forward(model: Decoder, seqs: Sequence[Seq], pool,
            layer_wait: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Runs every sequence's new tokens; returns the last position's logits per sequence
    (float32, [len(seqs), vocab]). `layer_wait(l)` is called before layer l reads cached KV."""
    c, dev = model.cfg, model.device
    ps = c.page_size
    if not seqs:
        raise ValueError("a batch needs at least one sequence")
    lens = [int(s.tokens.numel()) for s in seqs]
    if min(lens) < 1:
        raise ValueError("every sequence in a batch needs at least one new token")
    spans, pos_l, page_l, need_l = [], [], [], []
    at = 0
    for s, n in zip(seqs, lens):
        total = s.cached + n
        need = -(-total // ps)
        if s.pages.numel() < need:
            raise ValueError(f"{s.pages.numel()} pages cannot hold {total} tokens")
        pages = s.pages[:need].to(dev)
        pos = torch.arange(s.cached, total, device=dev)
        pos_l.append(pos)
        page_l.append(pages[pos // ps])
        need_l.append((pages, need, total))
        spans.append((at, at + n))
        at += n
    pos = torch.cat(pos_l)
    slot_page, slot_off = torch.cat(page_l), pos % ps
    toks = torch.cat([s.tokens for s in seqs]).to(dev)
    x = model.embed[toks]
    qd, kd = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
    cos, sin = model._rope_tables(pos)
    any_cached = any(s.cached for s in seqs)
    for li, L in enumerate(model.layers):
        h = _rms(x, L["ln1"], c.eps)
        qkv = h @ L["wqkv"]
        q = qkv[:, :qd].view(at, c.q_heads, c.head_dim)
        k = qkv[:, qd:qd + kd].view(at, c.kv_heads, c.head_dim)
        v = qkv[:, qd + kd:].view(at, c.kv_heads, c.head_dim)
        q = model._rope(_rms(q, L["qn"], c.eps), cos, sin)
        k = model._rope(_rms(k, L["kn"], c.eps), cos, sin)
        kc, vc = pool.k(li), pool.v(li)
        kc[slot_page, slot_off] = k
        vc[slot_page, slot_off] = v
        if layer_wait is not None and any_cached:
            layer_wait(li)
        outs: List[torch.Tensor] = []
        for s, (a, b), (pages, need, total) in zip(seqs, spans, need_l):
            ka = kc[pages].reshape(need * ps, c.kv_heads, c.head_dim)[:total].transpose(0, 1).unsqueeze(0)
            va = vc[pages].reshape(need * ps, c.kv_heads, c.head_dim)[:total].transpose(0, 1).unsqueeze(0)
            o = model._attend(q[a:b].transpose(0, 1).unsqueeze(0), ka, va, s.cached)
            outs.append(o[0].transpose(0, 1).reshape(b - a, qd))
        x = x + torch.cat(outs) @ L["wo"]
        h = _rms(x, L["ln2"], c.eps)
        g, u = (h @ L["wgu"]).chunk(2, dim=-1)
        x = x + (F.silu(g) * u) @ L["wd"]
    last = torch.tensor([b - 1 for _, b in spans], device=dev)
    return (_rms(x[last], model.norm, c.eps) @ model.lm_head).float()
