"""Fetch or recompute (issue 41): the engine's recompute cost, sent with a lookup, and the
daemon's fetch plan in the answer (kvnode_proto::plan, docs/fetch-plans.md).

    engine config ─ recompute_tokens_per_s, recompute_quad_s, recompute_ctx_s ─┐   (env KVNODE_RECOMPUTE_* wins)
                                                                                ▼
    Exists{keys, recompute: {page_tokens, keys_per_page, tokens_per_s, quad_s, [ctx_s],
                             start_tokens, [prompt_tokens], via}}
                                                               │
    Reply{count, plan: {keys, runs, reason, ...}} ─────────────┘
    usable = min(count, plan.keys), cut down to whole engine pages; the rest is recomputed

The cost model is the daemon's: computing the tokens `[c, x)` with `[0, c)` cached takes
`T(c, x) = (x - c) / tokens_per_s + quad_s * (x - c)² + ctx_s * (x - c) * c` seconds; from
nothing (`c = 0`) that is `R(x) = x / tokens_per_s + quad_s * x²`. `ctx_s` (seconds per token
computed per token already cached: the tail's attention to the cached context) is optional;
without it the daemon takes `2 * quad_s`, which makes `T(c, x) = R(x) - R(c)`. `prompt_tokens`
(the prompt's total tokens; optional, default the end of the looked-up keys) is where the
recompute ends. Measure the figures on the engine's GPU (docs/ttft.md, "Measuring the
recompute cost"): time prefills of a short and a long prompt with nothing cached and fit
`tokens_per_s` from the short one, `quad_s` from what the long one costs beyond it; then time the
long prompt's second half with its first half cached, and `ctx_s` is what that tail costs beyond
`T(0, n)` for its `n` tokens, per token and per cached token.

With no cost configured an integration sends no `recompute` and behaves as before.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

#: Config keys, the same in every integration's config (SGLang extra_config, the vLLM
#: connector's kv_connector_extra_config, the vLLM tier's secondary_tiers entry).
TOKENS_PER_S = "recompute_tokens_per_s"
QUAD_S = "recompute_quad_s"
CTX_S = "recompute_ctx_s"
#: Environment overrides (they win over the config; `KVNODE_RECOMPUTE_TOKENS_PER_S=0` turns
#: plans off whatever the config says).
ENV_TOKENS_PER_S = "KVNODE_RECOMPUTE_TOKENS_PER_S"
ENV_QUAD_S = "KVNODE_RECOMPUTE_QUAD_S"
ENV_CTX_S = "KVNODE_RECOMPUTE_CTX_S"
#: How the engine reads what the plan fetches (kvnode_proto::plan::ReadPath).
VIAS = ("copy", "region", "gpu")


class CostError(ValueError):
    """A recompute-cost setting kvnode cannot use; the message names the key."""


def _number(name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CostError(f"kvnode: {name} must be a number, got {value!r}")
    try:
        v = float(value)
    except ValueError:
        raise CostError(f"kvnode: {name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise CostError(f"kvnode: {name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return v


@dataclass(frozen=True)
class RecomputeCost:
    """The engine's prefill cost: `tokens_per_s` (linear term), `quad_s` (seconds per token²,
    the new tokens' attention to each other) and `ctx_s` (seconds per token computed per token
    cached, their attention to the cached context; None: the daemon takes `2 * quad_s`)."""

    tokens_per_s: float
    quad_s: float = 0.0
    ctx_s: Optional[float] = None

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill `tokens` tokens from nothing."""
        return tokens / self.tokens_per_s + self.quad_s * tokens * tokens

    def recompute_s(self, start: float, end: float) -> float:
        """Seconds to recompute the tokens `[start, end)` after a cached prefix (the daemon's
        `T(start, end)`)."""
        n = end - start
        ctx = 2.0 * self.quad_s if self.ctx_s is None else self.ctx_s
        return n / self.tokens_per_s + self.quad_s * n * n + ctx * n * start

    def wire(self, page_tokens: int, keys_per_page: int = 1, start_tokens: int = 0,
             via: str = "copy", prompt_tokens: Optional[int] = None) -> Dict[str, Any]:
        """The `recompute` field of an `Exists` (kvnode_proto::plan::RecomputeCost).
        `prompt_tokens`: the prompt's total tokens, where the lane's recompute ends (omitted:
        the daemon takes the end of the looked-up keys)."""
        if via not in VIAS:
            raise ValueError(f"via {via!r} is not one of {VIAS}")
        rc: Dict[str, Any] = {"page_tokens": max(1, int(page_tokens)),
                              "keys_per_page": max(1, int(keys_per_page)),
                              "tokens_per_s": float(self.tokens_per_s), "quad_s": float(self.quad_s),
                              "start_tokens": max(0, int(start_tokens)), "via": via}
        if self.ctx_s is not None:
            rc["ctx_s"] = float(self.ctx_s)
        if prompt_tokens is not None:
            rc["prompt_tokens"] = max(0, int(prompt_tokens))
        return {"recompute": rc}


def recompute_cost(config: Optional[Mapping[str, Any]], env: Optional[Mapping[str, str]] = None
                   ) -> Optional[RecomputeCost]:
    """The cost an integration's config declares (`recompute_tokens_per_s`, `recompute_quad_s`,
    optional `recompute_ctx_s`), the environment overriding it; None (no plans) when no
    tokens/s is set or it is 0."""
    config = config or {}
    env = os.environ if env is None else env
    tps: Any = config.get(TOKENS_PER_S)
    quad: Any = config.get(QUAD_S, 0.0)
    ctx: Any = config.get(CTX_S)
    if env.get(ENV_TOKENS_PER_S, "") != "":
        tps = env[ENV_TOKENS_PER_S]
    if env.get(ENV_QUAD_S, "") != "":
        quad = env[ENV_QUAD_S]
    if env.get(ENV_CTX_S, "") != "":
        ctx = env[ENV_CTX_S]
    if tps is None:
        for key, v in ((QUAD_S, quad), (CTX_S, ctx)):
            if v not in (None, 0, 0.0):
                raise CostError(f"kvnode: {key} is set but {TOKENS_PER_S} is not; set both "
                                "(docs/ttft.md, \"Measuring the recompute cost\")")
        return None
    t = _number(TOKENS_PER_S, tps, positive=False)
    if t == 0:
        return None
    return RecomputeCost(t, _number(QUAD_S, quad if quad is not None else 0.0, positive=False),
                         None if ctx is None else _number(CTX_S, ctx, positive=False))


@dataclass(frozen=True)
class Plan:
    """A fetch plan as the daemon answered it (kvnode_proto::plan::FetchPlan)."""

    keys: int
    reason: str
    available: int = 0
    fetch_s: float = 0.0
    recompute_s: float = 0.0
    cut_by: Optional[str] = None
    note: str = ""
    runs: Tuple[Tuple[str, int], ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, body: Optional[Mapping[str, Any]]) -> Optional["Plan"]:
        """The plan of an `Exists` reply body; None when it carries none (an older daemon, or
        no cost was sent)."""
        p = (body or {}).get("plan")
        if not p:
            return None
        runs = tuple((str(r.get("source", "")), int(r.get("keys", 0))) for r in p.get("runs") or [])
        return cls(keys=int(p.get("keys", 0)), reason=str(p.get("reason", "")),
                   available=int(p.get("available", 0)), fetch_s=float(p.get("fetch_s", 0.0)),
                   recompute_s=float(p.get("recompute_s", 0.0)), cut_by=p.get("cut_by"),
                   note=str(p.get("note", "")), runs=runs)

    @property
    def takes_peer(self) -> bool:
        return any(src == "peer" and n > 0 for src, n in self.runs)

    def log_line(self) -> str:
        runs = ",".join(f"{s}:{n}" for s, n in self.runs) or "-"
        cut = f" cut_by={self.cut_by}" if self.cut_by else ""
        return (f"plan {self.reason}{cut}: fetch {self.keys} of {self.available} keys [{runs}] "
                f"fetch {self.fetch_s * 1e3:.1f} ms vs recompute {self.recompute_s * 1e3:.1f} ms; {self.note}")


def usable_keys(count: int, plan: Optional[Plan], keys_per_page: int = 1) -> int:
    """Leading keys the engine takes: `count` (keys present), cut at the plan when there is one,
    then down to whole engine pages of `keys_per_page` keys."""
    n = int(count) if plan is None else min(int(count), plan.keys)
    k = max(1, int(keys_per_page))
    return max(0, n - n % k)


def cut_flags(flags: List[bool], plan: Optional[Plan], keys_per_page: int = 1) -> List[bool]:
    """Per-page presence flags with every page at or past the plan's cut set absent."""
    if plan is None:
        return flags
    pages = plan.keys // max(1, int(keys_per_page))
    return [f and i < pages for i, f in enumerate(flags)]
