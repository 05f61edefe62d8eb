"""The report: percentiles, rates and hit shares from per-request rows; Markdown and SVG output."""

import xml.etree.ElementTree as ET

import pytest

from harness import report as rp


def _row(ttft, prompt, computed, gpu=0, tier=0, **kw):
    r = {"ttft_s": ttft, "prompt_tokens": prompt, "computed_tokens": computed, "prefill_s": ttft * 0.8,
         "gpu_hit_tokens": gpu, "tier_hit_tokens": tier}
    r.update(kw)
    return r


def percentiles_rates_and_hit_shares_follow_the_stated_definitions():
    rows = [_row(0.1 * (i + 1), 1000, 500, gpu=250, tier=250, moved_bytes=250 * 1000, onload_s=0.01, stage_s=0.0)
            for i in range(10)]
    rows[0]["nvme_tokens"] = 100
    s = rp.arm_summary(rows)
    assert s["ttft_p50_ms"] == pytest.approx(550.0)
    assert s["ttft_p90_ms"] == pytest.approx(910.0)
    assert s["req_per_s"] == pytest.approx(10 / 5.5)
    assert s["prefill_tok_per_s"] == pytest.approx(5000 / (5.5 * 0.8))
    assert s["hit_gpu"] == pytest.approx(0.25) and s["hit_nvme"] == pytest.approx(0.01)
    assert s["hit_dram"] == pytest.approx(0.24) and s["computed_share"] == pytest.approx(0.5)
    assert s["fetch_GBps"] == pytest.approx(250e4 / 0.1 / 1e9)


def lockstep_workers_are_paced_by_the_slower_one_each_round():
    w0 = {"workload": {"arms": ["a2"], "results": {"a2": [_row(1.0, 10, 10), _row(1.0, 10, 10)]}}}
    w1 = {"workload": {"arms": ["a2"], "results": {"a2": [_row(3.0, 10, 10), _row(0.5, 10, 10)]}}}
    s = rp._phase2([w0, w1])
    assert s["a2"]["req_per_s"] == pytest.approx(4 / 4.0)


def the_prefill_fit_recovers_a_known_cost_model():
    rows = []
    for n in (100, 500, 1000, 2000, 4000):
        for c in (0, 1000, 3000):
            t = 0.002 + 2e-5 * n + 1e-9 * n * (c + n / 2)
            rows.append({"computed_tokens": n, "prompt_tokens": n + c, "prefill_s": t})
    fit = rp._fit_prefill(rows)
    assert fit["fixed_s"] == pytest.approx(0.002, rel=1e-3)
    assert fit["per_token_s"] == pytest.approx(2e-5, rel=1e-3)
    assert fit["per_token_ctx_s"] == pytest.approx(1e-9, rel=1e-3)


def markdown_and_svg_render_a_full_summary():
    rows_a = [_row(0.01 + 1e-4 * n + 1e-8 * n * n, n, n) for n in (500, 1000, 2000, 3000, 4000, 5000, 6000, 8000)]
    rows_b = [_row(0.05, 2000, 256, tier=1744, moved_bytes=1744 * 147456, onload_s=0.005,
                   first_token_equal_ref=True, max_abs_logit_diff_ref=0.01) for _ in range(8)]
    results = {
        "profile": "test", "config": {"model": "qwen3-8b"},
        "phase1": {
            "memcpy": {"bytes": 1 << 30, "h2d_GBps": 50.0, "d2h_GBps": 50.0},
            "correctness": {"dram": {"tier_hit_tokens": 640, "prompt_tokens": 740, "kv_pages_bitwise_equal": True,
                                     "logits_bitwise_equal_to_gpu_cached": True, "max_abs_diff_vs_full_recompute": 0.01,
                                     "first_token_equal_full_recompute": True, "logit_scale": 3.0}},
            "long_prefix": {"tokens": 32768, "suffix": 64, "page_bytes": 9437184, "prefix_bytes": 512 * 9437184,
                            "recompute": {"ttft_s": 1.5, "prefill_s": 1.5, "computed_tokens": 32832, "tflops": 500},
                            "dram": {"ttft_s": 0.12, "prefill_s": 0.02, "moved_bytes": 512 * 9437184, "lookup_s": 0.0002,
                                     "stage_s": 0.0, "onload_s": 0.1, "ttft_runs_s": [0.12, 0.13]},
                            "nvme": {"error": "boom"}},
            "workload": {"arms": ["a", "b"], "results": {"a": rows_a, "b": rows_b}},
        },
    }
    s = rp.build(results)
    assert s["long_prefix"]["dram"]["speedup_vs_recompute"] == pytest.approx(12.5)
    assert s["workload"]["b"]["req_per_s_gain"] > 0
    assert any("nvme" in e for e in s["errors"]) and not rp.ok(s)
    md = rp.markdown(s)
    assert "| b | 8 |" in md and "12.5x" in md and "Break-even" in md
    ET.fromstring(rp.svg(s))  # well-formed


def the_report_cli_rerenders_a_results_file_and_names_the_recompute_equivalent_bandwidth(tmp_path):
    import gzip
    import json
    rows = [_row(0.01 + 3e-5 * n, n, n) for n in (500, 1000, 2000, 4000, 8000)]
    results = {"profile": "t", "config": {"model": "qwen3-8b"},
               "phase1": {"long_prefix": {"tokens": 32768, "suffix": 64, "prefix_bytes": 4831838208,
                                          "recompute": {"ttft_s": 1.6, "prefill_s": 1.6}},
                          "workload": {"arms": ["a"], "results": {"a": rows}}}}
    src = tmp_path / "results.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump(results, f)
    assert rp.main([str(src), "--out", str(tmp_path / "r")]) == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    eq = s["recompute_equivalent_GBps"]
    assert eq["32768_tokens"] == pytest.approx(4831838208 / 1.6 / 1e9)
    assert eq["short_context"] == pytest.approx(147456 / (0.8 * 3e-5) / 1e9, rel=1e-3)  # _row: prefill = 0.8 TTFT
    assert "Recompute-equivalent bandwidth" in (tmp_path / "r" / "report.md").read_text()


def long_prefix_only_and_correctness_only_keep_just_the_named_paths():
    import copy

    from harness import run

    prof = copy.deepcopy(run.PROFILES["h200"])
    prof["long_prefix"]["only"] = ["dram", "dram_layerwise"]
    prof["correctness"]["only"] = ["dram_layerwise"]
    tier = lambda d, kind, ns, **kw: {"daemon": d, "kind": kind, "ns_name": ns, **kw}  # noqa: E731
    spec = run._phase1_spec(prof, ["long_prefix", "correctness"], {}, tier, 36)
    assert [p["name"] for p in spec["long_prefix"]["paths"]] == ["dram", "dram_layerwise"]
    assert spec["long_prefix"]["paths"][1]["tier"]["layers"] == 36
    assert [p[0] for p in spec["correctness"]["paths"]] == ["dram_layerwise"]
    # Without `only`, every path runs (NVMe, peers and the streamed pull included).
    full = run._phase1_spec(copy.deepcopy(run.PROFILES["h200"]), ["long_prefix"], {}, tier, 36)
    assert {"nvme", "peer", "peer_stream"} <= {p["name"] for p in full["long_prefix"]["paths"]}


def layer_wise_rows_report_when_every_layer_landed_beside_the_onload_wait():
    lp = {"recompute": {"ttft_s": 1.6},
          "dram_layerwise": {"ttft_s": 0.1, "moved_bytes": 4.8e9, "onload_s": 0.098, "lookup_s": 0.0004,
                             "layers_landed_s": 0.096}}
    row = rp._long(lp, {"h2d_GBps": 55.0})["dram_layerwise"]
    assert row["landed_GBps"] == pytest.approx(50.0)
    assert row["landed_vs_pinned_memcpy"] == pytest.approx(50.0 / 55.0)
    assert row["fetch_GBps"] == pytest.approx(4.8e9 / 0.098 / 1e9)
