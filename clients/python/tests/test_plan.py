"""kvnode.plan (issue 41): the recompute cost an integration sends with a lookup, its config and
environment, the plan in the answer, and the hinted lookup cut at the plan (scripted replies; the
integrations against real daemons are in test_plan_integrations.py).

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_plan.py`.
"""

import re
from pathlib import Path

import pytest

from kvnode.common import hinted_exists
from kvnode.plan import (CostError, Plan, RecomputeCost, cut_flags, recompute_cost, usable_keys)
from test_common import HINT, KEYS, Scripted

ROOT = Path(__file__).resolve().parents[3]
H100 = RecomputeCost(34_000.0, 6.3e-10)  # the fit of engine/proto/src/plan.rs's tests


def test_the_cost_is_the_daemons_model_r_of_b_minus_r_of_a():
    # The Rust test the_h100_fit_recomputes_32k_tokens_in_about_1_6_s, in tokens.
    assert 1.5 < H100.recompute_s(0, 512 * 64) < 1.7
    assert H100.recompute_s(16384, 32768) > H100.recompute_s(0, 16384), "the attention term"
    lin = RecomputeCost(1000.0)
    assert lin.recompute_s(100, 300) == pytest.approx(0.2)


def test_the_wire_field_names_are_the_rust_structs():
    """Every key `wire` sends is a field of kvnode_proto::plan::RecomputeCost, and every
    field without a serde default is sent (the daemon would refuse the request)."""
    src = (ROOT / "engine" / "proto" / "src" / "plan.rs").read_text()
    body = src[src.index("pub struct RecomputeCost"):]
    body = body[:body.index("\n}")]
    rust = set(re.findall(r"pub (\w+):", body))
    full = RecomputeCost(34_000.0, 6.3e-10, 2.5e-9).wire(64, 2, start_tokens=128, via="region", prompt_tokens=4100)
    assert set(full["recompute"]) == rust, (set(full["recompute"]), rust)
    sent = H100.wire(64, 2, start_tokens=128, via="region")["recompute"]
    assert sent == {"page_tokens": 64, "keys_per_page": 2, "tokens_per_s": 34_000.0,
                    "quad_s": 6.3e-10, "start_tokens": 128, "via": "region"}, "the optional ones only when set"
    assert full["recompute"] == dict(sent, ctx_s=2.5e-9, prompt_tokens=4100)
    with pytest.raises(ValueError):
        H100.wire(64, via="disk")


def test_no_tokens_per_s_means_no_plans_and_the_environment_wins():
    assert recompute_cost({}, env={}) is None
    assert recompute_cost({"recompute_tokens_per_s": 0}, env={}) is None
    assert recompute_cost({"recompute_tokens_per_s": 5e4, "recompute_quad_s": 1e-9}, env={}) == \
        RecomputeCost(5e4, 1e-9)
    env = {"KVNODE_RECOMPUTE_TOKENS_PER_S": "20000", "KVNODE_RECOMPUTE_QUAD_S": "2e-10"}
    assert recompute_cost({"recompute_tokens_per_s": 5e4}, env=env) == RecomputeCost(2e4, 2e-10)
    assert recompute_cost({}, env=env) == RecomputeCost(2e4, 2e-10), "the environment alone turns it on"
    off = {"KVNODE_RECOMPUTE_TOKENS_PER_S": "0"}
    assert recompute_cost({"recompute_tokens_per_s": 5e4}, env=off) is None, "0 turns it off"
    assert recompute_cost({"recompute_tokens_per_s": 5e4}, env={"KVNODE_RECOMPUTE_TOKENS_PER_S": ""}) \
        == RecomputeCost(5e4), "an empty variable is not set"


def test_the_context_term_from_config_or_environment():
    """`recompute_ctx_s` (env KVNODE_RECOMPUTE_CTX_S wins, as for the other keys): the daemon's
    T(c, x) = n / tokens_per_s + quad_s * n² + ctx_s * n * c; absent, ctx_s = 2 * quad_s."""
    c = recompute_cost({"recompute_tokens_per_s": 5e4, "recompute_quad_s": 1e-9, "recompute_ctx_s": 3e-9}, env={})
    assert c == RecomputeCost(5e4, 1e-9, 3e-9)
    assert c.recompute_s(1000, 3000) == pytest.approx(2000 / 5e4 + 1e-9 * 2000 ** 2 + 3e-9 * 2000 * 1000)
    assert recompute_cost({"recompute_tokens_per_s": 5e4, "recompute_ctx_s": 3e-9},
                          env={"KVNODE_RECOMPUTE_CTX_S": "4e-9"}).ctx_s == 4e-9
    assert recompute_cost({"recompute_tokens_per_s": 5e4}, env={"KVNODE_RECOMPUTE_CTX_S": ""}).ctx_s is None
    assert H100.ctx_s is None and H100.recompute_s(1000, 3000) == pytest.approx(
        H100.prefill_s(3000) - H100.prefill_s(1000)), "absent: 2 * quad_s, R(b) - R(a)"


@pytest.mark.parametrize("cfg,names", [
    ({"recompute_tokens_per_s": 1e4, "recompute_ctx_s": -1e-9}, "recompute_ctx_s"),
    ({"recompute_ctx_s": 1e-9}, "recompute_tokens_per_s"),
    ({"recompute_tokens_per_s": -1}, "recompute_tokens_per_s"),
    ({"recompute_tokens_per_s": "fast"}, "recompute_tokens_per_s"),
    ({"recompute_tokens_per_s": float("nan")}, "recompute_tokens_per_s"),
    ({"recompute_tokens_per_s": True}, "recompute_tokens_per_s"),
    ({"recompute_tokens_per_s": 1e4, "recompute_quad_s": -1e-9}, "recompute_quad_s"),
    ({"recompute_quad_s": 1e-9}, "recompute_tokens_per_s"),
])
def test_a_bad_cost_setting_is_refused_naming_the_key(cfg, names):
    with pytest.raises(CostError, match=names):
        recompute_cost(cfg, env={})


PLAN = {"keys": 4, "runs": [{"source": "dram", "keys": 2}, {"source": "nvme", "keys": 2}],
        "fetch_s": 0.01, "recompute_s": 0.02, "reason": "slower", "cut_by": "nvme",
        "available": 6, "note": "nvme loses past key 4"}


def test_a_reply_plan_is_read_and_its_line_names_the_reason():
    p = Plan.of({"count": 6, "plan": PLAN})
    assert (p.keys, p.reason, p.cut_by, p.available) == (4, "slower", "nvme", 6)
    assert p.runs == (("dram", 2), ("nvme", 2)) and not p.takes_peer
    assert "slower" in p.log_line() and "cut_by=nvme" in p.log_line()
    assert Plan.of({"count": 6}) is None and Plan.of(None) is None, "an older daemon: no plan"
    assert Plan.of({"count": 1, "plan": dict(PLAN, runs=[{"source": "peer", "keys": 1}])}).takes_peer


def test_usable_keys_cut_at_the_plan_then_at_whole_pages():
    p = Plan.of({"plan": PLAN})
    assert usable_keys(6, None) == 6, "no plan: the count"
    assert usable_keys(6, p) == 4
    assert usable_keys(3, p) == 3, "fewer present than planned: what is present"
    assert usable_keys(6, p, keys_per_page=3) == 3, "page of 3 keys: 4 keys hold one whole page"
    assert usable_keys(5, None, keys_per_page=2) == 4
    assert cut_flags([True, True, True], p, keys_per_page=2) == [True, True, False]
    assert cut_flags([True, False, True], None) == [True, False, True]


RC = H100.wire(64)


def test_a_hinted_lookup_whose_plan_leaves_the_peer_out_is_not_waited_for_and_is_cut():
    conn = Scripted([{"count": 6, "plan": PLAN}])
    found = hinted_exists(conn, 3, KEYS, {**HINT, **RC}, 250)
    assert [c[0] for c in conn.calls] == ["Exists"]
    assert conn.calls[0][1]["recompute"] == RC["recompute"], "the cost goes with the hinted Exists"
    assert found.count == 4 and found.plan.reason == "slower" and not found.waited


def test_a_planned_peer_pull_is_waited_for_and_the_recount_is_cut_at_the_plan():
    running = {"op": 9, "state": "Pulling", "results": ["Pending"] * 2, "reason": None}
    peer = dict(PLAN, keys=5, reason="slower", runs=[{"source": "dram", "keys": 1},
                                                     {"source": "peer", "keys": 4}])
    conn = Scripted([{"count": 1, "pull": running, "plan": peer}, {"count": 6}],
                    {"op": 9, "state": "Done", "results": ["Pulled"] * 2, "reason": None})
    found = hinted_exists(conn, 3, KEYS, {**HINT, **RC}, 250)
    assert [c[0] for c in conn.calls] == ["Exists", "Wait", "Exists"]
    assert "recompute" not in conn.calls[2][1], "the recount is a plain count"
    assert found.waited and found.plan.takes_peer
    assert found.count == 5, "min(recount, plan.keys): plan.keys exceeded the first count"


def test_without_a_cost_the_hinted_lookup_is_unchanged():
    conn = Scripted([{"count": 2}])
    found = hinted_exists(conn, 3, KEYS, HINT, 250)
    assert found.plan is None and found.count == 2
    assert "recompute" not in conn.calls[0][1]
