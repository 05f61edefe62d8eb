"""An engine-like decode step: one token for a batch of sequences, captured in CUDA graphs.

What vLLM and SGLang do for decode, in the harness's decoder:
  - a batch is padded up to a batch-size bucket (1, 2, 4, 8, ...); each bucket's step is
    captured once in a CUDA graph over static input buffers (token, position, block table,
    context length, the slot the new K/V goes to) and replayed per step: no per-kernel launch
    cost, no host work inside the step;
  - attention is ONE call per layer for the whole batch over the paged pool
    (harness/paged_attn.py: a split-K Triton kernel reading pages in place, or the SDPA
    reference), not one SDPA per sequence over gathered KV as `batched.forward` does;
  - the linear layers run once over the batch, as before.
Padding rows repeat row 0 (same token, position and pages): they write the same K/V to the
same slot as row 0 and their outputs are dropped, so no scratch page is needed.

On the CPU (the CI profile) the same step runs eagerly, with the SDPA attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import fused as fz
from . import paged_attn
from .model import Decoder, _rms

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DecodeSeq:
    last: int            # the token to feed (the previous step's output)
    ctx: int             # tokens whose KV is in the pool before it; it goes to position ctx
    pages: List[int]     # page ids covering positions 0 .. ctx


class _Bucket:
    """Static buffers (and on CUDA the captured graph) of one batch size."""

    def __init__(self, dec: "GraphDecoder", size: int):
        dev, c = dec.model.device, dec.model.cfg
        self.size = size
        self.tok = torch.zeros(size, dtype=torch.long, device=dev)
        self.pos = torch.zeros(size, dtype=torch.long, device=dev)
        self.bt = torch.zeros(size, dec.max_pages, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(size, dtype=torch.int32, device=dev)  # keys incl. the new token
        self.out = torch.zeros(size, dtype=torch.long, device=dev)
        self.splits = paged_attn.splits_for(size, c.kv_heads, dec.sms)
        self.scratch = None
        if dec.attn == "triton":
            self.scratch = (torch.empty(size, c.q_heads, self.splits, c.head_dim, device=dev, dtype=torch.float32),
                            torch.empty(size, c.q_heads, self.splits, device=dev, dtype=torch.float32))
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None


class GraphDecoder:
    """Decode steps of `model` over `pool` for up to `max_pages` pages per sequence."""

    def __init__(self, model: Decoder, pool, max_pages: int, max_batch: int,
                 attn: Optional[str] = None, graphs: Optional[bool] = None, fused: bool = False):
        cuda = model.device.type == "cuda"
        self.model, self.pool, self.max_pages = model, pool, max_pages
        self.fused = fused  # Triton RMSNorm and q/k-norm+RoPE+KV-write kernels (harness/fused.py)
        if fused and paged_attn.triton is None:
            raise ValueError("fused decode kernels need triton")
        self.attn = attn or ("triton" if cuda and paged_attn.triton is not None else "sdpa")
        if self.attn not in ("triton", "sdpa"):
            raise ValueError(f"unknown decode attention {self.attn!r}; use 'triton' or 'sdpa'")
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.sms = torch.cuda.get_device_properties(model.device).multi_processor_count if cuda else 132
        sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.buckets: Dict[int, _Bucket] = {b: _Bucket(self, b) for b in sorted(set(sizes))}
        self.capture_s = 0.0
        self.steps = 0
        if self.graphs:
            self._capture_all()

    # -- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _body(self, bk: _Bucket) -> None:
        m, c = self.model, self.model.cfg
        ps, n = c.page_size, bk.size
        qd, kd = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
        slot_page = bk.bt.gather(1, (bk.pos // ps).unsqueeze(1).to(torch.int64)).squeeze(1).long()
        slot_off = bk.pos % ps
        x = m.embed[bk.tok]
        cos, sin = m._rope_tables(bk.pos)
        for li, L in enumerate(m.layers):
            kc, vc = self.pool.k(li), self.pool.v(li)
            if self.fused:
                qkv = fz.rms_norm(x, L["ln1"], c.eps) @ L["wqkv"]
                q = fz.qk_norm_rope(qkv, L["qn"], L["kn"], cos, sin, kc, vc, slot_page, slot_off,
                                    c.q_heads, c.kv_heads, c.eps)
            else:
                h = _rms(x, L["ln1"], c.eps)
                qkv = h @ L["wqkv"]
                q = qkv[:, :qd].view(n, c.q_heads, c.head_dim)
                k = qkv[:, qd:qd + kd].view(n, c.kv_heads, c.head_dim)
                v = qkv[:, qd + kd:].view(n, c.kv_heads, c.head_dim)
                q = m._rope(_rms(q, L["qn"], c.eps), cos, sin)
                k = m._rope(_rms(k, L["kn"], c.eps), cos, sin)
                kc[slot_page, slot_off] = k
                vc[slot_page, slot_off] = v
            if self.attn == "triton":
                o = paged_attn.triton_decode(q, kc, vc, bk.bt, bk.ctx, bk.splits, bk.scratch)
            else:
                o = paged_attn.sdpa_reference(q, kc, vc, bk.bt, bk.ctx)
            x = x + o.reshape(n, qd) @ L["wo"]
            h = fz.rms_norm(x, L["ln2"], c.eps) if self.fused else _rms(x, L["ln2"], c.eps)
            g, u = (h @ L["wgu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["wd"]
        logits = _rms(x, m.norm, c.eps) @ m.lm_head
        bk.logits = logits  # the graph's own output tensor when captured (tests read it)
        bk.out.copy_(torch.argmax(logits.float(), dim=-1))

    def _capture_all(self) -> None:
        import time
        t = time.perf_counter()
        dev = self.model.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for bk in self.buckets.values():
                # Warm-up off the graph (Triton compiles, cuBLAS picks kernels). The initial inputs
                # point every row at page 0, position 0, one key: the warm-up writes K/V into page
                # 0's first slot, so that slot is saved before and restored after.
                keep = [(self.pool.k(li)[0, 0].clone(), self.pool.v(li)[0, 0].clone())
                        for li in range(self.model.cfg.layers)]
                self._body(bk)
                self._body(bk)
                side.synchronize()
                g = torch.cuda.CUDAGraph()
                # thread_local: the tier's offload thread may touch CUDA while this captures
                with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
                    self._body(bk)
                bk.graph = g
                for li, (k0, v0) in enumerate(keep):
                    self.pool.k(li)[0, 0] = k0
                    self.pool.v(li)[0, 0] = v0
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t

    def bucket_for(self, n: int) -> _Bucket:
        for b, bk in self.buckets.items():
            if b >= n:
                return bk
        raise ValueError(f"decode batch of {n} exceeds the largest bucket {max(self.buckets)}")

    @torch.inference_mode()
    def step(self, seqs: Sequence[DecodeSeq]) -> List[int]:
        """One token for every sequence; returns the next tokens (on the host)."""
        if not seqs:
            raise ValueError("a decode step needs at least one sequence")
        bk = self.bucket_for(len(seqs))
        ps = self.model.cfg.page_size
        rows = list(seqs) + [seqs[0]] * (bk.size - len(seqs))
        bt = torch.zeros(bk.size, self.max_pages, dtype=torch.int32)
        for i, s in enumerate(rows):
            need = s.ctx // ps + 1
            if need > self.max_pages or need > len(s.pages):
                raise ValueError(f"a sequence at position {s.ctx} needs {need} pages; it has {len(s.pages)},"
                                 f" the decoder takes {self.max_pages}")
            bt[i, :need] = torch.tensor(s.pages[:need], dtype=torch.int32)
        bk.bt.copy_(bt, non_blocking=True)
        bk.tok.copy_(torch.tensor([s.last for s in rows]), non_blocking=True)
        bk.pos.copy_(torch.tensor([s.ctx for s in rows]), non_blocking=True)
        bk.ctx.copy_(torch.tensor([s.ctx + 1 for s in rows], dtype=torch.int32), non_blocking=True)
        if bk.graph is not None:
            bk.graph.replay()
        else:
            self._body(bk)
        self.steps += 1
        return bk.out[: len(seqs)].tolist()
