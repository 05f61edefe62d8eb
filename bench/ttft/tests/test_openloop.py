"""Open-loop mode (CPU, tiny decoder): arrivals, the batched forward, the serving loop, the sweep."""

import pytest
import torch

from harness import batched, openloop, sweep_report
from harness import model as m
from harness import pool as pl
from harness.lane import Lane
from harness import workload as wl

WL = wl.WorkloadConfig(seed=2, vocab=m.TINY.vocab, page_size=16, sys_len=32, docs=2, doc_len=64, doc_prob=1.0,
                    sessions=4, turns=3, user_len=16, answer_len=16)


def arrivals_are_seeded_poisson_and_the_same_for_every_arm():
    a = openloop.arrivals(4000, 50.0, seed=7)
    assert a == openloop.arrivals(4000, 50.0, seed=7)
    assert a != openloop.arrivals(4000, 50.0, seed=8)
    assert all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 50.0, rel=0.08)
    # Exponential gaps: the coefficient of variation is 1 (a fixed-interval stream would be 0).
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert sd / mean == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        openloop.OpenLoopConfig(rate=0).check()


def a_batched_step_gives_each_sequence_the_logits_of_its_own_prefill_and_decode():
    dec = m.Decoder(m.TINY, "cpu", seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, m.TINY.vocab, (n,), generator=g) for n in (40, 23, 57)]
    ref_pool = pl.KvPool(m.TINY, 16, "cpu", "layer_first", torch.float32)
    refs, pages = [], []
    for i, p in enumerate(prompts):
        pg = torch.arange(5 * i, 5 * i + 5)
        refs.append(dec.prefill(p, 0, pg, ref_pool))
        pages.append(pg)
    pool = pl.KvPool(m.TINY, 16, "cpu", "layer_first", torch.float32)
    out = batched.forward(dec, [batched.Seq(p, 0, pg) for p, pg in zip(prompts, pages)], pool)
    for i in range(3):
        assert torch.allclose(out[i], refs[i], atol=1e-4, rtol=1e-4)
        assert int(out[i].argmax()) == int(refs[i].argmax())
    # The same KV was written: a decode step over it equals a one-pass prefill of prompt + token.
    nxt = out.argmax(-1)
    dec_out = batched.forward(dec, [batched.Seq(nxt[i:i + 1], len(p), pg)
                                    for i, (p, pg) in enumerate(zip(prompts, pages))], pool)
    for i, p in enumerate(prompts):
        one = dec.prefill(torch.cat([p, nxt[i:i + 1]]), 0, pages[i], pl.KvPool(m.TINY, 16, "cpu", "layer_first", torch.float32))
        assert torch.allclose(dec_out[i], one, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pages"):
        batched.forward(dec, [batched.Seq(prompts[0], 0, pages[0][:2])], pool)


def _lane(pages=48):
    dec = m.Decoder(m.TINY, "cpu", seed=1)
    return Lane("ol", dec, pl.KvPool(m.TINY, pages, "cpu"))


def the_serving_loop_queues_under_overload_and_returns_every_page():
    reqs = wl.generate(WL)
    ln = _lane()
    slow = openloop.OpenLoop(ln, openloop.OpenLoopConfig(rate=2000.0, decode_tokens=3, max_running=3,
                                                        max_prefill_tokens=1000)).run(reqs)
    assert slow["requests"] == len(reqs)
    rows = slow["rows"]
    assert all(r["output_tokens"] == 4 for r in rows)
    # Arrivals far faster than service: later requests wait in the queue, and TTFT counts it.
    assert max(r["queue_s"] for r in rows) > 0.5 * max(r["ttft_s"] for r in rows) > 0
    assert all(r["ttft_s"] >= r["queue_s"] for r in rows)
    # Requests share prefill steps, and at most max_running are in flight.
    assert max(r["batch_seqs"] for r in rows) > 1 and max(r["batch_seqs"] for r in rows) <= 3
    assert slow["steps"]["decode"] > 0
    # Later turns of a session hit the prefix cache (they resend the earlier turn).
    assert sum(r["gpu_hit_tokens"] for r in rows) > 0
    # Everything is unpinned at the end; the pool's pages are free or cached.
    c = ln.cache
    assert not c.pins and len(c.free) + len(c.owner) == c.capacity
    # At a low rate nobody waits long, and the requests arrive in the stated order.
    fast = openloop.OpenLoop(_lane(), openloop.OpenLoopConfig(rate=5.0, decode_tokens=1)).run(reqs[:4])
    assert [r["idx"] for r in fast["rows"]] == [q.idx for q in reqs[:4]]
    assert fast["achieved_req_per_s"] < 20


def a_request_larger_than_the_pool_is_refused_up_front():
    reqs = wl.generate(WL)
    with pytest.raises(pl.PoolFull, match="needs"):
        openloop.OpenLoop(_lane(pages=4), openloop.OpenLoopConfig(rate=10.0)).run(reqs)


def the_sweep_finds_the_highest_rate_under_each_bound_and_compares_at_equal_rate():
    assert sweep_report.sustained([(1, 100), (2, 200), (4, 600)], 400) == {
        "grid": 2, "interpolated": pytest.approx(3.0), "saturated": True}
    assert sweep_report.sustained([(1, 100), (2, 200)], 400) == {"grid": 2, "interpolated": 2, "saturated": False}
    assert sweep_report.sustained([(1, 900)], 400)["grid"] is None

    def run(arm, rate, ttft_ms):
        rows = [{"ttft_s": t / 1e3, "queue_s": 0.0, "prompt_tokens": 100, "tier_hit_tokens": 50 if arm == "b" else 0,
                 "gpu_hit_tokens": 10} for t in ttft_ms]
        return {"arm": arm, "rate": rate, "rows": rows, "achieved_req_per_s": rate, "output_tok_per_s": 1.0,
                "wall_s": 1.0}
    sw = {"arms": ["a", "b"], "bounds_ms": [300], "requests": 10,
          "runs": [run("a", 2, [100] * 10), run("b", 2, [50] * 10), run("b", 4, [100] * 10),
                   run("a", 4, [500] * 10), run("b", 8, [500] * 10)]}
    s = sweep_report.summarize(sw)
    assert s["sustained"]["a"]["300"]["interpolated"] == pytest.approx(3.0)
    assert s["sustained"]["b"]["300"]["interpolated"] == pytest.approx(6.0)
    assert s["gain"]["b"]["300"] == pytest.approx(1.0)
    eq = {row["rate"]: row for row in s["equal_rate"]}
    assert eq[4]["a"]["ttft_p90_ms"] == pytest.approx(500) and eq[8]["a"] is None
    md = sweep_report.markdown(s)
    assert "+100 %" in md and "| 4 (4.00) |" in md


def sustained_rates_are_read_off_the_offered_rates_not_the_nominal_ones():
    def run(arm, rate, offered, p90):
        rows = [{"ttft_s": p90 / 1e3, "queue_s": 0.0, "prompt_tokens": 1, "tier_hit_tokens": 0, "gpu_hit_tokens": 0}]
        return {"arm": arm, "rate": rate, "offered_req_per_s": offered, "rows": rows, "achieved_req_per_s": offered,
                "output_tok_per_s": 1.0, "wall_s": 1.0, "steps": [{"decode": 4, "decode_s": 0.02, "decode_seqs": 8},
                                                                   {"decode": 6, "decode_s": 0.03, "decode_seqs": 6}]}
    sw = {"arms": ["a"], "bounds_ms": [300], "requests": 1,
          "runs": [run("a", 2, 2.5, 100), run("a", 4, 4.5, 500)]}
    s = sweep_report.summarize(sw)
    x = s["sustained"]["a"]["300"]
    assert (x["grid"], x["nominal"]) == (2.5, 2) and x["interpolated"] == pytest.approx(3.5)
    # Two workers' steps: 10 steps in 50 ms, 14 sequences.
    row = s["by_arm"]["a"][0]
    assert row["decode_step_ms"] == pytest.approx(5.0) and row["decode_batch"] == pytest.approx(1.4)
    assert "| 2 (2.50) |" in sweep_report.markdown(s, "two workers")
