"""The recompute-cost fit for fetch plans (harness/worker.py: fit_recompute_cost,
Worker._fit_cost), in the daemon's model: computing tokens [c, x) with [0, c) cached takes
T(c, x) = n / tokens_per_s + quad_s * n² + ctx_s * n * c, n = x − c. tokens_per_s and quad_s
come from two full prefills, ctx_s from a tail after a cached head."""

import pytest

from harness import worker

Worker = worker.Worker

A, Q, C = 1 / 33_000, 9.4e-10, 3.1e-9  # s/token, s/token², s/token/cached token


def _T(c, x, a=A, q=Q, ctx=C):
    n = x - c
    return a * n + q * n * n + ctx * n * c


def the_three_term_fit_recovers_every_coefficient():
    f = worker.fit_recompute_cost(8192, _T(0, 8192), 32832, _T(0, 32832), 16384, _T(16384, 32832))
    assert f["tokens_per_s"] == pytest.approx(33_000, rel=1e-9)
    assert f["quad_s"] == pytest.approx(Q, rel=1e-9)
    assert f["ctx_s"] == pytest.approx(C, rel=1e-9)
    assert not f["fallback_linear"] and not f["ctx_fallback"]
    T = f["T"]
    for c, x in ((0, 8192), (0, 32832), (16384, 32832), (4096, 20000)):
        assert T(c, x) == pytest.approx(_T(c, x), rel=1e-9)


def a_tail_no_dearer_than_its_tokens_falls_back_to_twice_quad():
    # ctx_s would not be positive: the daemon's default, 2 * quad_s (T = R(x) − R(c)).
    t_tail = _T(0, 32832 - 16384) * 0.9
    f = worker.fit_recompute_cost(8192, _T(0, 8192), 32832, _T(0, 32832), 16384, t_tail)
    assert f["ctx_fallback"] and f["ctx_s"] == pytest.approx(2 * Q, rel=1e-9)
    assert f["quad_s"] == pytest.approx(Q, rel=1e-9)
    f = worker.fit_recompute_cost(8192, _T(0, 8192), 32832, _T(0, 32832), 0, 1.0)  # no head
    assert f["ctx_fallback"] and f["ctx_s"] == pytest.approx(2 * Q, rel=1e-9)


def noisy_full_prefills_fall_back_to_a_linear_fit():
    # The short prompt dearer per token than the long one: quad_s < 0, so a line through the long.
    f = worker.fit_recompute_cost(8192, _T(0, 32832) / 2, 32832, _T(0, 32832), 16384, _T(16384, 32832))
    assert f["fallback_linear"] and f["quad_s"] == 0.0
    assert f["tokens_per_s"] == pytest.approx(32832 / _T(0, 32832), rel=1e-9)
    f = worker.fit_recompute_cost(100, 1.0, 100, 1.0, 50, 0.9)  # the same point twice
    assert f["fallback_linear"]


class _Cfg:
    page_size, vocab = 16, 512


class _Cache:
    def __init__(self):
        self.held = []  # token prefixes computed (whole pages)

    def clear(self):
        self.held = []


class _Lane:
    """Serves a prompt in the synthetic time T(hit, n), hit = the longest cached leading run
    of whole pages (at least one token computed), like Lane.serve with a GPU prefix cache."""

    def __init__(self, ctx=C):
        self.cache, self.ctx, self.served = _Cache(), ctx, []

    def serve(self, req):
        toks, ps = req.tokens, _Cfg.page_size
        n = len(toks)
        hit = 0
        for h in self.cache.held:
            k = min(len(h), (n - 1) // ps * ps)
            if toks[:k] == h[:k]:
                hit = max(hit, k)
        t = _T(hit, n, ctx=self.ctx)
        self.cache.held.append(list(toks[: n // ps * ps]))
        self.served.append((n, hit))
        return {"ttft_s": t, "gpu_hit_tokens": hit, "computed_tokens": n - hit}


class _Self:
    cfg = _Cfg()
    req = Worker.req


def fit_cost_fits_two_full_prefills_and_the_tail_after_half_the_prompt():
    prompt = list(range(512)) + list(range(1000, 1016))  # 528 tokens, 33 pages
    lane = _Lane()
    cost = Worker._fit_cost(_Self(), lane, {"ttft_s": _T(0, 528)}, prompt,
                            {"mixed_dram_frac": 0.5, "plan_fit_tokens": 128})
    fit = cost["fit"]
    assert fit["tail_head_tokens"] == 16 * 16  # int(32 pages * 0.5) whole pages
    assert fit["tail_tokens"] == 528 - 256 and fit["short_tokens"] == 128 and fit["long_tokens"] == 528
    assert cost["tokens_per_s"] == pytest.approx(33_000, rel=1e-6)
    assert cost["quad_s"] == pytest.approx(Q, rel=1e-6)
    assert cost["ctx_s"] == pytest.approx(C, rel=1e-6)
    for k in ("short", "long", "tail"):
        assert fit[f"{k}_predicted_s"] == pytest.approx(fit[f"{k}_s"], rel=1e-6), k
    assert not fit["fallback_linear"] and not fit["ctx_fallback"]
    assert (256, 0) in lane.served and (528, 256) in lane.served  # head from nothing, then the tail


def fit_cost_without_a_context_term_sends_the_default():
    # Tails that cost exactly R(x) − R(c): ctx_s comes out 2 * quad_s (the daemon's default).
    prompt = list(range(528))
    cost = Worker._fit_cost(_Self(), _Lane(ctx=2 * Q), {"ttft_s": _T(0, 528)}, prompt,
                            {"mixed_dram_frac": 0.5, "plan_fit_tokens": 128})
    assert cost["ctx_s"] == pytest.approx(2 * Q, rel=1e-6)
    assert cost["fit"]["tail_predicted_s"] == pytest.approx(cost["fit"]["tail_s"], rel=1e-6)


def the_plan_lookup_sends_ctx_s_and_the_prompt_length():
    from harness.tier import DaemonTier, Load, TierSpec

    sent = []

    class _Conn:
        def call(self, op):
            sent.append(op)
            return None, {"count": 0}, None

    t = DaemonTier.__new__(DaemonTier)
    t.spec = TierSpec(sock="x", kind="nvme", mover="copy",
                      plan={"tokens_per_s": 33_000.0, "quad_s": Q, "ctx_s": C})
    t.pool = type("P", (), {"cfg": _Cfg()})()
    t.router, t.conn, t.ns, t.offload_shared = None, _Conn(), 1, False
    t._planned(Load(), [b"a" * 32, b"b" * 32], [b"a" * 32, b"b" * 32], 3, prompt_tokens=100)
    rc = sent[0]["Exists"]["recompute"]
    assert rc["ctx_s"] == C and rc["prompt_tokens"] == 100 and rc["start_tokens"] == 3 * 16
    t.spec = TierSpec(sock="x", kind="nvme", mover="copy", plan={"tokens_per_s": 33_000.0, "quad_s": Q})
    t._planned(Load(), [b"a" * 32], [b"a" * 32], 0)
    assert "ctx_s" not in sent[1]["Exists"]["recompute"] and "prompt_tokens" not in sent[1]["Exists"]["recompute"]
