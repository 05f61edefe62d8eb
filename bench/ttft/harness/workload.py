"""Seeded shared-prefix traffic: multi-turn chats resending their history, documents shared across users.

Every session starts with one system prompt shared by all sessions; with probability
`doc_prob` it then carries one of `docs` documents (shared by every session that drew it).
Turn t's prompt is  system ‖ [document] ‖ (user_1 ‖ answer_1) ‖ … ‖ (user_{t-1} ‖ answer_{t-1}) ‖ user_t ;
answers stand in for the decoded tokens of earlier turns. Requests interleave sessions in a
seeded random order, so the time between two turns of one session is long enough for a
small GPU pool to evict the history (the situation a node-level cache is for).

Pages are addressed like SGLang's: a chained SHA-256 over full pages (digest_i =
SHA-256(digest_{i-1} ‖ token ids of page i as u32 LE)); a partial last page has no digest.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 1
    vocab: int = 151936
    page_size: int = 64
    sys_len: int = 512
    docs: int = 6
    doc_len: int = 3072
    doc_prob: float = 0.75
    sessions: int = 24
    turns: int = 4
    user_len: int = 256
    answer_len: int = 192

    def check(self) -> None:
        for name in ("vocab", "page_size", "sessions", "turns", "user_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1")
        for name in ("sys_len", "docs", "doc_len", "answer_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"workload {name} must be >= 0")
        if not 0.0 <= self.doc_prob <= 1.0:
            raise ValueError("workload doc_prob must be in [0, 1]")
        if self.doc_prob > 0 and (self.docs == 0 or self.doc_len == 0):
            raise ValueError("doc_prob > 0 needs docs >= 1 and doc_len >= 1")


@dataclass
class Request:
    idx: int
    session: int
    turn: int
    doc: Optional[int]
    tokens: List[int] = field(repr=False)

    def summary(self) -> Dict:
        d = asdict(self)
        d["tokens"] = len(self.tokens)
        return d


def _tokens(rng_seed: str, n: int, vocab: int) -> List[int]:
    r = random.Random(rng_seed)
    return [r.randrange(vocab) for _ in range(n)]


def generate(cfg: WorkloadConfig) -> List[Request]:
    """The request stream (deterministic in `cfg`)."""
    cfg.check()
    s = cfg.seed
    system = _tokens(f"{s}/sys", cfg.sys_len, cfg.vocab)
    docs = [_tokens(f"{s}/doc/{d}", cfg.doc_len, cfg.vocab) for d in range(cfg.docs)]
    r = random.Random(f"{s}/plan")
    doc_of = [r.randrange(cfg.docs) if r.random() < cfg.doc_prob else None for _ in range(cfg.sessions)]
    # Seeded interleaving: each step draws a session that still has turns left.
    left = {k: cfg.turns for k in range(cfg.sessions)}
    history = {k: list(system) + (list(docs[doc_of[k]]) if doc_of[k] is not None else [])
               for k in range(cfg.sessions)}
    out: List[Request] = []
    while left:
        k = r.choice(sorted(left))
        t = cfg.turns - left[k]
        user = _tokens(f"{s}/user/{k}/{t}", cfg.user_len, cfg.vocab)
        out.append(Request(len(out), k, t, doc_of[k], history[k] + user))
        history[k] = history[k] + user + _tokens(f"{s}/answer/{k}/{t}", cfg.answer_len, cfg.vocab)
        left[k] -= 1
        if not left[k]:
            del left[k]
    return out


def page_digests(tokens: List[int], page_size: int) -> List[bytes]:
    """Chained SHA-256 digests of the full pages of `tokens`."""
    out, prev = [], b""
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *page)).digest()
        out.append(prev)
    return out


def hint_hash(digest: bytes) -> int:
    """The router's u64 block hash for a page: its digest's first 8 bytes, big-endian (peer-protocol.md)."""
    return int.from_bytes(digest[:8], "big")


def stats(requests: List[Request], page_size: int) -> Dict:
    """Distinct working set and traffic totals."""
    distinct = set()
    prompt_tokens = 0
    for q in requests:
        distinct.update(page_digests(q.tokens, page_size))
        prompt_tokens += len(q.tokens)
    lens = sorted(len(q.tokens) for q in requests)
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "distinct_pages": len(distinct),
        "distinct_tokens": len(distinct) * page_size,
        "prompt_len_min": lens[0] if lens else 0,
        "prompt_len_p50": lens[len(lens) // 2] if lens else 0,
        "prompt_len_max": lens[-1] if lens else 0,
    }
