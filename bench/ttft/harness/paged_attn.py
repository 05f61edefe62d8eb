"""Decode attention over a paged KV pool: one call per layer for a whole batch of sequences.

Each sequence has one new query token (all query heads) and `ctx_lens[b]` tokens of KV in pool
pages listed by its row of `block_table`. Two implementations of the same function:

  triton  flash-decoding (split-K), the way SGLang's triton backend and vLLM's paged attention
          decode: grid (batch, kv head, split); a program reads its split's pages straight from
          the pool (no gather), keeps an online softmax for the kv head's query-head group, and
          writes a partial output and its log-sum-exp; the splits are merged by a few torch ops.
          Only the pages a sequence has are read, so a step moves the bytes an engine moves.
  sdpa    reference (CPU, and a fallback): gather every row's pages into a padded [B, M*ps]
          tensor and run torch's SDPA with a key mask.

Both read only device tensors and have static shapes for a fixed (batch, max pages), so a step
built on them can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

try:  # the device image has triton; the CPU test venv may have it too (TRITON_INTERPRET=1)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def sdpa_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_table: torch.Tensor,
                   ctx_lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D]; kc/vc [pages, ps, Hkv, D]; block_table [B, M] (int); ctx_lens [B] -> [B, Hq, D]."""
    b, m = block_table.shape
    ps, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    idx = block_table.long()
    k = kc[idx].reshape(b, m * ps, hkv, d).transpose(1, 2)
    v = vc[idx].reshape(b, m * ps, hkv, d).transpose(1, 2)
    keep = torch.arange(m * ps, device=q.device)[None, :] < ctx_lens.long()[:, None]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=keep[:, None, None, :],
                                       enable_gqa=True)
    return o.squeeze(2)


if triton is not None:
    @triton.jit
    def _decode_split(Q, K, V, BT, CTX, OP, LSE, scale,
                      sq_b, sq_h, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h, sbt_b,
                      so_b, so_h, so_s, sl_b, sl_h,
                      GROUP: tl.constexpr, G_PAD: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                      SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CTX + b)
        npages = tl.cdiv(ctx, PS)
        per = tl.cdiv(npages, SPLITS)
        p0 = s * per
        p1 = tl.minimum(p0 + per, npages)
        g = tl.arange(0, G_PAD)
        dd = tl.arange(0, D)
        tt = tl.arange(0, PS)
        gmask = g < GROUP
        qh = h * GROUP + g
        q = tl.load(Q + b * sq_b + qh[:, None] * sq_h + dd[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for p in range(p0, p1):
            page = tl.load(BT + b * sbt_b + p).to(tl.int64)
            k = tl.load(K + page * sk_p + tt[:, None] * sk_t + h * sk_h + dd[None, :])
            sc = tl.dot(q, tl.trans(k)) * scale
            valid = (p * PS + tt) < ctx
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(V + page * sv_p + tt[:, None] * sv_t + h * sv_h + dd[None, :])
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m_i = m_new
        safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(safe), float("-inf"))
        tl.store(OP + b * so_b + qh[:, None] * so_h + s * so_s + dd[None, :], out, mask=gmask[:, None])
        tl.store(LSE + b * sl_b + qh * sl_h + s, lse, mask=gmask)


def splits_for(batch: int, kv_heads: int, sms: int = 132) -> int:
    """Splits per (sequence, kv head) so a step's grid covers the GPU about twice."""
    return max(1, min(32, (2 * sms) // max(1, batch * kv_heads)))


def triton_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_table: torch.Tensor,
                  ctx_lens: torch.Tensor, splits: int,
                  scratch: Optional[tuple] = None) -> torch.Tensor:
    """The split-K kernel plus the merge; same contract as `sdpa_reference`.

    `scratch` = (partial out [B, Hq, splits, D] f32, lse [B, Hq, splits] f32), reused by a
    captured graph; allocated here when None."""
    if triton is None:
        raise RuntimeError("triton is not installed: use attention 'sdpa'")
    bsz, hq, d = q.shape
    ps, hkv = kc.shape[1], kc.shape[2]
    if kc.stride(3) != 1 or vc.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged decode needs the head dim contiguous")
    group = hq // hkv
    op, lse = scratch if scratch is not None else (
        torch.empty(bsz, hq, splits, d, device=q.device, dtype=torch.float32),
        torch.empty(bsz, hq, splits, device=q.device, dtype=torch.float32))
    _decode_split[(bsz, hkv, splits)](
        q, kc, vc, block_table, ctx_lens, op, lse, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), block_table.stride(0),
        op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), PS=ps, D=d, SPLITS=splits)
    w = torch.softmax(lse, dim=-1)
    return (w.unsqueeze(-1) * op).sum(2).to(q.dtype)
