"""Fused elementwise kernels for the decode step (harness/decode.py with `fused=True`).

An eager torch decode layer is ~60 small kernels (RMSNorm alone is seven: cast, square, mean,
add, rsqrt, multiply, cast); inside a CUDA graph their launch gaps and tails still cost a few
milliseconds per step, which engines remove by fusing them. Two Triton kernels here:

  rms_norm      one program per row: the norm in float32, the result cast to bf16, times w
                (the same arithmetic as model._rms);
  qk_norm_rope  one program per (token, head) over the fused QKV output: q/k RMSNorm and
                rotate-half RoPE for q and k heads, and the token's K/V written straight into its
                pool slot; q comes back as [n, Hq, D].
"""

from __future__ import annotations

import torch

from .paged_attn import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_kernel(X, W, Y, sx, sy, eps, H: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        x = tl.load(X + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
        y = (x * r).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * sy + cols, (y * w).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_kernel(QKV, QN, KN, COS, SIN, Q, KC, VC, SLOT_P, SLOT_O, eps,
                   s_qkv, s_q_n, s_q_h, s_cs, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h,
                   HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1)  # 0..HQ-1 q heads, HQ..HQ+HKV-1 k heads, then v heads
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        base = QKV + n * s_qkv + h * D
        if h < HQ + HKV:
            x1 = tl.load(base + i).to(tl.float32)
            x2 = tl.load(base + half + i).to(tl.float32)
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
            if h < HQ:
                w1 = tl.load(QN + i).to(tl.float32)
                w2 = tl.load(QN + half + i).to(tl.float32)
            else:
                w1 = tl.load(KN + i).to(tl.float32)
                w2 = tl.load(KN + half + i).to(tl.float32)
            # _rms: normalised value cast to bf16, times the bf16 weight, rounded to bf16
            y1 = ((x1 * r).to(tl.bfloat16).to(tl.float32) * w1).to(tl.bfloat16).to(tl.float32)
            y2 = ((x2 * r).to(tl.bfloat16).to(tl.float32) * w2).to(tl.bfloat16).to(tl.float32)
            c = tl.load(COS + n * s_cs + i)
            s = tl.load(SIN + n * s_cs + i)
            o1 = (y1 * c - y2 * s).to(tl.bfloat16)
            o2 = (y2 * c + y1 * s).to(tl.bfloat16)
            if h < HQ:
                qb = Q + n * s_q_n + h * s_q_h
                tl.store(qb + i, o1)
                tl.store(qb + half + i, o2)
            else:
                p = tl.load(SLOT_P + n).to(tl.int64)
                t = tl.load(SLOT_O + n).to(tl.int64)
                kb = KC + p * sk_p + t * sk_t + (h - HQ) * sk_h
                tl.store(kb + i, o1)
                tl.store(kb + half + i, o2)
        else:
            p = tl.load(SLOT_P + n).to(tl.int64)
            t = tl.load(SLOT_O + n).to(tl.int64)
            vb = VC + p * sv_p + t * sv_t + (h - HQ - HKV) * sv_h
            v1 = tl.load(base + i)
            v2 = tl.load(base + half + i)
            tl.store(vb + i, v1)
            tl.store(vb + half + i, v2)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    n, h = x.shape
    y = torch.empty_like(x)
    _rms_kernel[(n,)](x, w, y, x.stride(0), y.stride(0), eps, H=h, BLOCK=triton.next_power_of_2(h))
    return y


def qk_norm_rope(qkv: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kc: torch.Tensor, vc: torch.Tensor, slot_page: torch.Tensor, slot_off: torch.Tensor,
                 q_heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """qkv [n, (Hq + 2 Hkv) * D] bf16; cos/sin [n, 1, D/2] float32; returns q [n, Hq, D] and writes
    the K (normed, roped) and V of each token into kc/vc at (slot_page, slot_off)."""
    n = qkv.shape[0]
    d = kc.shape[-1]
    q = torch.empty(n, q_heads, d, device=qkv.device, dtype=qkv.dtype)
    cs, sn = cos.reshape(n, d // 2).contiguous(), sin.reshape(n, d // 2).contiguous()
    _qk_kernel[(n, q_heads + 2 * kv_heads)](
        qkv, qn, kn, cs, sn, q, kc, vc, slot_page, slot_off, eps,
        qkv.stride(0), q.stride(0), q.stride(1), cs.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        HQ=q_heads, HKV=kv_heads, D=d)
    return q
