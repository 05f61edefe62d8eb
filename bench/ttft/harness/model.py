"""A decoder with Qwen3's shapes and random weights, prefilling into a paged KV pool.

Per layer: RMSNorm, fused QKV projection, per-head q/k RMSNorm, RoPE, attention through
torch's SDPA (flash for a prefill from scratch, the fused lower-right-causal kernel when a
cached prefix precedes the new tokens), output projection, SwiGLU MLP. The new tokens' K/V
are written into pool pages; attention reads the prefix back from those pages, so KV that a
tier loaded into a page is used exactly as KV computed in place. Only the last position goes
through the final norm and the LM head: the first generated token is its argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shapes. `page_size` is tokens per KV page."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    page_size: int = 64
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def params(self) -> int:
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        o = self.q_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (qkv + o + mlp) + 2 * self.vocab * self.hidden


#: Qwen3-8B (config.json of Qwen/Qwen3-8B): 36 layers, hidden 4096, 32 q / 8 kv heads of 128.
QWEN3_8B = ModelConfig("qwen3-8b-shapes", 36, 4096, 32, 8, 128, 12288, 151936)
#: A few-layer model with the same per-layer shapes, for quick GPU runs.
QWEN3_8B_4L = replace(QWEN3_8B, name="qwen3-8b-shapes-4l", layers=4)
#: CPU tests: the same structure at toy size (GQA 2:1), 16-token pages of 256 KiB (big enough
#: for a working set to overflow the daemon's smallest DRAM tier, 8 MiB, into the spill dir).
TINY = ModelConfig("tiny", 4, 128, 8, 4, 128, 256, 512, page_size=16)

CONFIGS = {"qwen3-8b": QWEN3_8B, "qwen3-8b-4l": QWEN3_8B_4L, "tiny": TINY}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Decoder:
    """Random-weight decoder (seeded). Weights are created directly on `device`."""

    def __init__(self, cfg: ModelConfig, device: str, seed: int = 0, dtype=torch.bfloat16):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        g = torch.Generator(device=self.device).manual_seed(seed)
        c = cfg

        def w(*shape, std=0.02):
            return (torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32) * std).to(dtype)

        self.embed = w(c.vocab, c.hidden, std=1.0)
        self.lm_head = w(c.hidden, c.vocab)
        self.norm = torch.ones(c.hidden, device=self.device, dtype=dtype)
        qkv = (c.q_heads + 2 * c.kv_heads) * c.head_dim
        self.layers = []
        for _ in range(c.layers):
            self.layers.append({
                "ln1": torch.ones(c.hidden, device=self.device, dtype=dtype),
                "ln2": torch.ones(c.hidden, device=self.device, dtype=dtype),
                "qn": torch.ones(c.head_dim, device=self.device, dtype=dtype),
                "kn": torch.ones(c.head_dim, device=self.device, dtype=dtype),
                "wqkv": w(c.hidden, qkv),
                "wo": w(c.q_heads * c.head_dim, c.hidden),
                "wgu": w(c.hidden, 2 * c.intermediate),
                "wd": w(c.intermediate, c.hidden),
            })
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, device=self.device,
                                                              dtype=torch.float32) / half))

    def _rope_tables(self, pos: torch.Tensor):
        f = pos.float()[:, None] * self._inv_freq[None, :]
        return f.cos()[:, None, :], f.sin()[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [n, heads, d]; rotate-half convention, in float32.
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h].float(), x[..., h:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
        # q: [1, Hq, n, d]; k, v: [1, Hkv, cached + n, d] (GQA: SDPA shares each KV head
        # among Hq/Hkv query heads). New token i sits at position cached + i: causal from
        # scratch, lower-right causal after a cached prefix (flash when available).
        if cached == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cached: int, pages: torch.Tensor, pool,
                layer_wait: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Runs `tokens` (the uncached tail) after `cached` tokens whose KV is in `pool`.

        `pages`: page ids covering every token 0 .. cached + n (cached is a multiple of
        page_size). Writes the new tokens' K/V into their pages; returns the last position's
        logits (float32, [vocab]). `layer_wait(l)`, if given, is called before layer l first
        reads the cached prefix's KV (a layer-wise onload: it returns once layer l landed).
        """
        c = self.cfg
        ps = c.page_size
        n = int(tokens.numel())
        if cached % ps:
            raise ValueError(f"cached prefix of {cached} tokens is not whole {ps}-token pages")
        total = cached + n
        need = -(-total // ps)
        if pages.numel() < need:
            raise ValueError(f"{pages.numel()} pages cannot hold {total} tokens")
        pages = pages[:need].to(self.device)
        pos = torch.arange(cached, total, device=self.device)
        slot_page = pages[pos // ps]
        slot_off = pos % ps
        x = self.embed[tokens.to(self.device)]
        qd, kd = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
        cos, sin = self._rope_tables(pos)
        for li, L in enumerate(self.layers):
            h = _rms(x, L["ln1"], c.eps)
            qkv = h @ L["wqkv"]
            q = qkv[:, :qd].view(n, c.q_heads, c.head_dim)
            k = qkv[:, qd:qd + kd].view(n, c.kv_heads, c.head_dim)
            v = qkv[:, qd + kd:].view(n, c.kv_heads, c.head_dim)
            q = self._rope(_rms(q, L["qn"], c.eps), cos, sin)
            k = self._rope(_rms(k, L["kn"], c.eps), cos, sin)
            kc, vc = pool.k(li), pool.v(li)
            kc[slot_page, slot_off] = k
            vc[slot_page, slot_off] = v
            if layer_wait is not None and cached:
                layer_wait(li)
            ka = kc[pages].reshape(need * ps, c.kv_heads, c.head_dim)[:total]
            va = vc[pages].reshape(need * ps, c.kv_heads, c.head_dim)[:total]
            ka = ka.transpose(0, 1).unsqueeze(0)
            va = va.transpose(0, 1).unsqueeze(0)
            o = self._attend(q.transpose(0, 1).unsqueeze(0), ka, va, cached)
            x = x + o[0].transpose(0, 1).reshape(n, qd) @ L["wo"]
            h = _rms(x, L["ln2"], c.eps)
            g, u = (h @ L["wgu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["wd"]
        last = _rms(x[-1:], self.norm, c.eps)
        return (last @ self.lm_head).float()[0]


def prefill_flops(cfg: ModelConfig, cached: int, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens after `cached` (linear layers + causal attention)."""
    lin = 2 * n * (cfg.params - 2 * cfg.vocab * cfg.hidden) + 2 * cfg.hidden * cfg.vocab
    # QK^T and PV over the causal band: each new token i attends cached + i + 1 keys.
    keys = n * cached + n * (n + 1) / 2
    att = 4 * cfg.layers * cfg.q_heads * cfg.head_dim * keys
    return lin + att


def pick_device(requested: Optional[str]) -> str:
    if requested:
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"
