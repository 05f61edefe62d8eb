"""Turns a run's results.json into a summary (numbers), a Markdown report and an SVG plot.

Definitions (stated in the report too):
  TTFT          request arrival at the worker -> first token on the host (prefill-only requests)
  req/s         closed loop, one request in flight per worker: requests / sum of TTFTs; with two
                workers in lockstep, 2 * rounds / sum over rounds of the slower worker's TTFT.
                That is 1 / mean TTFT restated, NOT throughput under concurrent load (not
                measured here): compare arms by TTFT, never with an engine's QPS
  prefill tok/s tokens computed / time spent computing them
  hit rate      share of prompt tokens served from each place (GPU cache, local DRAM, NVMe, peer)
  fetch GB/s    bytes loaded into the pool / (staging + onload time), per request path
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

from . import sweep_report


def pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def arm_summary(rows: List[Dict], rounds: Optional[List[float]] = None) -> Dict:
    ttft = [r["ttft_s"] for r in rows]
    n = len(rows)
    prompt = sum(r["prompt_tokens"] for r in rows) or 1
    computed = sum(r["computed_tokens"] for r in rows)
    prefill_s = sum(r["prefill_s"] for r in rows)
    nvme = sum(r.get("nvme_tokens", 0) for r in rows)
    pulled = sum(r.get("pulled_tokens", 0) for r in rows)
    tier = sum(r["tier_hit_tokens"] for r in rows)
    moved = sum(r.get("moved_bytes", 0) for r in rows)
    fetch_t = sum(r.get("stage_s", 0) + r.get("onload_s", 0) for r in rows)
    onload_t = sum(r.get("onload_s", 0) for r in rows)
    busy = sum(rounds) if rounds else sum(ttft)
    agree = [r["first_token_equal_ref"] for r in rows if "first_token_equal_ref" in r]
    diffs = [r["max_abs_logit_diff_ref"] for r in rows if "max_abs_logit_diff_ref" in r]
    return {
        "requests": n,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p90_ms": pct(ttft, 90) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3, "ttft_mean_ms": (sum(ttft) / n * 1e3) if n else float("nan"),
        "req_per_s": (len(rows) / busy) if busy else float("nan"),
        "prefill_tok_per_s": computed / prefill_s if prefill_s else float("nan"),
        "prompt_tokens": prompt, "computed_tokens": computed,
        "hit_gpu": sum(r["gpu_hit_tokens"] for r in rows) / prompt,
        "hit_dram": (tier - nvme - pulled) / prompt,
        "hit_nvme": nvme / prompt, "hit_peer": pulled / prompt,
        "computed_share": computed / prompt,
        "moved_gb": moved / 1e9,
        "fetch_GBps": moved / fetch_t / 1e9 if fetch_t else None,
        "onload_GBps": moved / onload_t / 1e9 if onload_t else None,
        "first_token_agreement": (sum(agree) / len(agree)) if agree else None,
        "max_abs_logit_diff": max(diffs) if diffs else None,
    }


def _phase2(workers: List[Dict]) -> Dict:
    out = {}
    if not any("workload" in w for w in workers) and any("openloop" in w for w in workers):
        return {}
    wls = [w.get("workload") for w in workers]
    if not all(isinstance(w, dict) and "results" in w for w in wls):
        return {"error": [w.get("error") or (w.get("workload") or {}).get("error") for w in workers]}
    for arm in wls[0]["arms"]:
        per = [w["results"][arm] for w in wls]
        k = min(len(p) for p in per)
        rounds = [max(p[i]["ttft_s"] for p in per) for i in range(k)]
        rows = [r for p in per for r in p[:k]]
        out[arm] = arm_summary(rows, rounds)
    return out


def _fit_prefill(rows: List[Dict]) -> Optional[Dict]:
    """Least squares prefill_s = a + b*n + c*n*ctx_avg over requests (n computed, ctx cached+n/2)."""
    pts = [(r["computed_tokens"], r["prompt_tokens"] - r["computed_tokens"], r["prefill_s"]) for r in rows
           if r["computed_tokens"] > 0]
    if len(pts) < 4:
        return None
    X = [[1.0, n, n * (c + n / 2)] for n, c, _ in pts]
    y = [t for *_, t in pts]
    # Normal equations (3x3), solved by Gaussian elimination.
    A = [[sum(X[i][p] * X[i][q] for i in range(len(X))) for q in range(3)] for p in range(3)]
    b = [sum(X[i][p] * y[i] for i in range(len(X))) for p in range(3)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(A[r][col]))
        if abs(A[piv][col]) < 1e-30:
            return None
        A[col], A[piv], b[col], b[piv] = A[piv], A[col], b[piv], b[col]
        for r in range(3):
            if r != col:
                f = A[r][col] / A[col][col]
                A[r] = [A[r][j] - f * A[col][j] for j in range(3)]
                b[r] -= f * b[col]
    a0, a1, a2 = (b[i] / A[i][i] for i in range(3))
    return {"fixed_s": a0, "per_token_s": a1, "per_token_ctx_s": a2}


def prefill_model(fit: Dict, n: float, ctx: float) -> float:
    return fit["fixed_s"] + fit["per_token_s"] * n + fit["per_token_ctx_s"] * n * (ctx + n / 2)


def break_even(summary: Dict) -> Optional[Dict]:
    """Per path: the prefix length above which fetching it beats recomputing it, and TTFT ratios."""
    fit = summary.get("prefill_fit")
    lp = summary.get("long_prefix") or {}
    kvb = summary.get("kv_bytes_per_token")
    if not fit or not kvb:
        return None
    out = {}
    for path, row in lp.items():
        if not isinstance(row, dict) or path in ("recompute", "gpu_cached") or not row.get("fetch_GBps"):
            continue
        bw = row["fetch_GBps"] * 1e9
        fixed = row.get("fixed_overhead_s", 0.0)
        # Smallest cached prefix n (whole pages) with fixed + n*kvb/bw < prefill(n tokens from scratch).
        n_star = None
        for n in range(64, 1 << 20, 64):
            if fixed + n * kvb / bw < prefill_model(fit, n, 0) - fit["fixed_s"]:
                n_star = n
                break
        grid = {}
        for total in (2048, 8192, 32768):
            for h in (0.25, 0.5, 0.9):
                hit = int(total * h) // 64 * 64
                t_fetch = fixed + hit * kvb / bw + prefill_model(fit, total - hit, hit)
                t_rec = prefill_model(fit, total, 0)
                grid[f"{total}@{h}"] = t_rec / t_fetch
        out[path] = {"GBps": row["fetch_GBps"], "fixed_s": fixed, "break_even_tokens": n_star,
                     "ttft_gain_by_len_and_hit": grid}
    return out


def _long(lp: Dict, memcpy: Optional[Dict]) -> Dict:
    out = {}
    rec = lp.get("recompute", {}).get("ttft_s")
    for k, v in lp.items():
        if not isinstance(v, dict) or ("ttft_s" not in v and "error" not in v):
            continue  # not a path (e.g. plan_cost)
        if "error" in v:
            out[k] = {"error": v["error"]}
            continue
        row = {"ttft_ms": v["ttft_s"] * 1e3, "runs_ms": [x * 1e3 for x in v.get("ttft_runs_s", [])],
               "prefill_ms": v.get("prefill_s", 0) * 1e3, "computed_tokens": v.get("computed_tokens"),
               "tier_hit_tokens": v.get("tier_hit_tokens"), "gpu_hit_tokens": v.get("gpu_hit_tokens")}
        if rec:
            row["speedup_vs_recompute"] = rec / v["ttft_s"]
        if v.get("disk_throttle"):
            row["disk_throttle"] = v["disk_throttle"]
        if v.get("plans"):
            row["plans"] = [None if p is None else {k: p.get(k) for k in ("reason", "keys", "available", "cut_by",
                                                                          "fetch_s", "recompute_s", "runs")}
                            for p in v["plans"]]
        if v.get("moved_bytes"):
            t = v.get("stage_s", 0) + v.get("onload_s", 0)
            row.update({"lookup_ms": v.get("lookup_s", 0) * 1e3, "stage_ms": v.get("stage_s", 0) * 1e3,
                        "onload_ms": v.get("onload_s", 0) * 1e3, "moved_gb": v["moved_bytes"] / 1e9,
                        "fetch_GBps": v["moved_bytes"] / t / 1e9 if t else None,
                        "fixed_overhead_s": v.get("lookup_s", 0),
                        "pulled_tokens": v.get("pulled_tokens"), "promoted_pages": v.get("promoted_pages"),
                        "promoted_pages_per_rep": v.get("promoted_pages_per_rep")})
            if memcpy and memcpy.get("h2d_GBps") and row["fetch_GBps"]:
                row["fetch_vs_pinned_memcpy"] = row["fetch_GBps"] / memcpy["h2d_GBps"]
            if v.get("layers_landed_s"):
                # Layer-wise: onload_ms ends at OnloadWait, after the prefill; the copies ended
                # when the last layer's wait was answered.
                row["layers_landed_ms"] = v["layers_landed_s"] * 1e3
                row["landed_GBps"] = v["moved_bytes"] / v["layers_landed_s"] / 1e9
                if memcpy and memcpy.get("h2d_GBps"):
                    row["landed_vs_pinned_memcpy"] = row["landed_GBps"] / memcpy["h2d_GBps"]
        out[k] = row
    if "tflops" in lp.get("recompute", {}):
        out["recompute"]["tflops"] = lp["recompute"]["tflops"]
    return out


#: (arm, fetch-all row, plan row) of the fetch-plan comparison (issue 41).
PLAN_ARMS = (("NVMe (host disk)", "nvme", "nvme_plan"), ("mixed: DRAM then NVMe", "mixed", "mixed_plan"),
             ("mixed: DRAM then a disk limited to X GB/s", "mixed_slow", "mixed_slow_plan"),
             ("peer behind a shaped link", "peer_slow", "peer_slow_plan"))
#: Arms where the plan must beat both fetch-all and recompute (a prefix part fast, part slow).
BEATS_BOTH = ("mixed", "mixed_slow")


def plan_verdicts(lp: Dict, cost: Optional[Dict] = None) -> Dict:
    """Per arm: TTFT of fetch-all, the plan and recompute (medians), and whether the plan is
    within 5 % of the better of the two (and, for the mixed prefixes, beats both)."""
    out = {}
    rec = (lp.get("recompute") or {}).get("ttft_ms")
    for title, fetch, plan in PLAN_ARMS:
        f, p = lp.get(fetch) or {}, lp.get(plan) or {}
        if "ttft_ms" not in f or "ttft_ms" not in p or not rec:
            continue
        best = min(f["ttft_ms"], rec)
        bps = (f.get("disk_throttle") or p.get("disk_throttle") or {}).get("read_bps")
        if "X GB/s" in title:
            title = title.replace("X GB/s", f"{bps / 1e9:.3g} GB/s" if bps else "? GB/s")
        v = {"arm": title, "fetch_all_ms": f["ttft_ms"], "plan_ms": p["ttft_ms"], "recompute_ms": rec,
             "plan_vs_best": p["ttft_ms"] / best, "within_5pct": p["ttft_ms"] <= 1.05 * best,
             "plan_tier_hit_tokens": p.get("tier_hit_tokens"), "fetch_tier_hit_tokens": f.get("tier_hit_tokens"),
             "plan_reasons": sorted({(x or {}).get("reason") or "-" for x in p.get("plans") or [None]})}
        if fetch in BEATS_BOTH:
            v["beats_both"] = p["ttft_ms"] < best
        out[plan] = v
    return out


def build(results: Dict) -> Dict:
    from .model import CONFIGS
    s: Dict = {"profile": results.get("profile"), "started": results.get("started"), "errors": []}
    cfg = results.get("config", {})
    if cfg.get("model") in CONFIGS:
        s["kv_bytes_per_token"] = CONFIGS[cfg["model"]].kv_bytes_per_token
    p1 = results.get("phase1") or {}
    s["device"] = p1.get("device_name") or next(
        (w.get("device_name") for w in results.get("phase2") or [] if w.get("device_name")), None)
    for sec in ("memcpy", "correctness", "long_prefix", "workload"):
        v = p1.get(sec)
        if isinstance(v, dict) and "error" in v:
            s["errors"].append(f"phase1 {sec}: {v['error']}")
    if p1.get("error"):
        s["errors"].append(f"phase1: {p1['error']}")
    s["memcpy"] = p1.get("memcpy")
    s["correctness"] = p1.get("correctness")
    if isinstance(p1.get("long_prefix"), dict) and "error" not in p1["long_prefix"]:
        lp = p1["long_prefix"]
        s["long_prefix_meta"] = {k: lp[k] for k in ("tokens", "suffix", "page_bytes", "prefix_bytes", "prefill_tflop") if k in lp}
        s["long_prefix"] = _long(lp, s["memcpy"])
        if lp.get("plan_cost"):
            s["plan_cost"] = lp["plan_cost"]
            s["plans"] = plan_verdicts(s["long_prefix"])
        s["plans_skipped"] = {k: v for k, v in lp.items() if k.endswith("_skipped")}
        for k, v in s["long_prefix"].items():
            if "error" in v:
                s["errors"].append(f"long_prefix {k}: {v['error']}")
    wl = p1.get("workload")
    if isinstance(wl, dict) and "results" in wl:
        s["workload"] = {arm: arm_summary(rows) for arm, rows in wl["results"].items()}
        s["workload_finish"] = wl.get("finish")
        s["prefill_fit"] = _fit_prefill(wl["results"].get("a", []))
    if results.get("phase2"):
        s["workload2"] = _phase2(results["phase2"])
        if "error" in s["workload2"]:
            s["errors"].append(f"phase2: {s['workload2']['error']}")
        w0 = results["phase2"][0]
        if "openloop" in w0:  # every worker holds the merged runs; worker 0's are reported
            s["openloop2"] = sweep_report.summarize(w0["openloop"])
            if "error" in s["openloop2"]:
                s["errors"].append(f"phase2 openloop: {s['openloop2']['error']}")
        for w in results["phase2"]:
            if w.get("error"):
                s["errors"].append(f"phase2 worker: {w['error']}")
    for key, ref in (("workload", "a"), ("workload2", "a2")):
        w = s.get(key)
        if isinstance(w, dict) and ref in w:
            for arm, row in w.items():
                if arm != ref:
                    row["req_per_s_gain"] = row["req_per_s"] / w[ref]["req_per_s"] - 1
                    row["ttft_p50_change"] = row["ttft_p50_ms"] / w[ref]["ttft_p50_ms"] - 1
                    row["ttft_mean_change"] = row["ttft_mean_ms"] / w[ref]["ttft_mean_ms"] - 1
    if "openloop" in p1:
        s["openloop"] = sweep_report.summarize(p1["openloop"])
        if "error" in s["openloop"]:
            s["errors"].append(f"phase1 openloop: {s['openloop']['error']}")
    s["break_even"] = break_even(s)
    s["recompute_equivalent_GBps"] = recompute_equivalent(s)
    return s


def recompute_equivalent(s: Dict) -> Optional[Dict]:
    """The bandwidth at which fetching a prefix takes as long as recomputing it.

    short: KV bytes per token / marginal prefill time per token at no context (the fit);
    long:  the long prefix's KV bytes / its measured recompute time. A path faster than this
    (and with sub-millisecond fixed cost, as all measured paths have) beats recompute.
    """
    out = {}
    fit, kvb = s.get("prefill_fit"), s.get("kv_bytes_per_token")
    if fit and kvb and fit["per_token_s"] > 0:
        out["short_context"] = kvb / fit["per_token_s"] / 1e9
    lp, meta = s.get("long_prefix") or {}, s.get("long_prefix_meta") or {}
    if lp.get("recompute", {}).get("ttft_ms") and meta.get("prefix_bytes"):
        out[f"{meta['tokens']}_tokens"] = meta["prefix_bytes"] / (lp["recompute"]["ttft_ms"] / 1e3) / 1e9
    return out or None


def ok(s: Dict) -> bool:
    """No section failed, and where the correctness section ran, the DRAM path's KV pages and
    logits were bitwise right (a run of other sections only, e.g. the open-loop sweep, passes
    on its own)."""
    if s["errors"]:
        return False
    c = s.get("correctness")
    if c is None:
        return True
    dram = c.get("dram") or {}
    return bool(dram.get("kv_pages_bitwise_equal")) and bool(dram.get("logits_bitwise_equal_to_gpu_cached"))


def _f(x, fmt="{:.1f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return fmt.format(x)


def markdown(s: Dict) -> str:
    L: List[str] = [f"# TTFT run ({s.get('profile')}, {s.get('device') or 'cpu'}, {s.get('started')})", ""]
    if s["errors"]:
        L += ["**Errors:**", ""] + [f"- {e}" for e in s["errors"]] + [""]
    m = s.get("memcpy") or {}
    if m.get("h2d_GBps"):
        L += [f"Pinned copy reference (same run, {m['bytes'] / 2**30:.0f} GiB): H2D {m['h2d_GBps']:.1f} GB/s, "
              f"D2H {m['d2h_GBps']:.1f} GB/s.", ""]
    for key, title in (("workload", "Workload, one worker per arm (arms interleaved request by request)"),
                       ("workload2", "Workload, two worker processes in lockstep")):
        w = s.get(key)
        if not isinstance(w, dict) or not w or "error" in w:
            continue
        L += [f"## {title}", "",
              "| arm | req | TTFT p50 ms | p90 | p99 | mean | req/s (= 1/mean TTFT) | vs GPU-only | prefill tok/s | "
              "hit GPU | DRAM | NVMe | peer | computed | moved GB | fetch GB/s | first token = ref |",
              "|---|" + "---|" * 16]
        for arm, r in w.items():
            gain = r.get("req_per_s_gain")
            L.append(
                f"| {arm} | {r['requests']} | {_f(r['ttft_p50_ms'])} | {_f(r['ttft_p90_ms'])} | {_f(r['ttft_p99_ms'])} | "
                f"{_f(r['ttft_mean_ms'])} | {_f(r['req_per_s'], '{:.2f}')} | "
                f"{_f(None if gain is None else gain * 100, '{:+.0f} %')} | {_f(r['prefill_tok_per_s'], '{:.0f}')} | "
                f"{r['hit_gpu']:.0%} | {r['hit_dram']:.0%} | {r['hit_nvme']:.0%} | {r['hit_peer']:.0%} | "
                f"{r['computed_share']:.0%} | {r['moved_gb']:.1f} | {_f(r['fetch_GBps'])} | "
                f"{_f(None if r['first_token_agreement'] is None else r['first_token_agreement'] * 100, '{:.0f} %')} |")
        L.append("")
    lp = s.get("long_prefix")
    if lp:
        meta = s.get("long_prefix_meta", {})
        L += [f"## One long prefix ({meta.get('tokens')} tokens + {meta.get('suffix')} new, "
              f"{_f(meta.get('prefix_bytes', 0) / 1e9, '{:.2f}')} GB of KV)", "",
              "| path | TTFT ms (median) | runs | speedup vs recompute | lookup ms | stage ms | onload ms | compute ms | fetch GB/s | of pinned memcpy |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for k, r in lp.items():
            if "error" in r:
                L.append(f"| {k} | error: {r['error']} |||||||||")
                continue
            L.append(f"| {k} | {_f(r['ttft_ms'])} | {', '.join(f'{x:.0f}' for x in r['runs_ms'])} | "
                     f"{_f(r.get('speedup_vs_recompute'), '{:.1f}x')} | {_f(r.get('lookup_ms'), '{:.2f}')} | "
                     f"{_f(r.get('stage_ms'))} | {_f(r.get('onload_ms'))} | {_f(r['prefill_ms'])} | "
                     f"{_f(r.get('fetch_GBps'))} | {_f(None if r.get('fetch_vs_pinned_memcpy') is None else r['fetch_vs_pinned_memcpy'] * 100, '{:.0f} %')} |")
        L.append("")
        pv = s.get("plans")
        if pv:
            cost = s.get("plan_cost") or {}
            L += ["### Fetch or recompute (plans)", "",
                  f"Recompute cost sent with each lookup: {cost.get('tokens_per_s', 0):.0f} tokens/s + "
                  f"{cost.get('quad_s', 0):.3g} s/token²"
                  + (f" + {cost['ctx_s']:.3g} s/token/cached token" if cost.get("ctx_s") is not None else "")
                  + f" ({'given' if 'fit' not in cost else 'fitted in this run: ' + str(cost['fit'])}).", "",
                  "| arm | fetch all ms | plan ms | recompute ms | plan / min(fetch, recompute) | ≤ 1.05 | plan fetched tokens | plan reasons |",
                  "|---|---|---|---|---|---|---|---|"]
            for r in pv.values():
                ok = "yes" if r["within_5pct"] else "**no**"
                if "beats_both" in r:
                    ok += ", beats both" if r["beats_both"] else ", **does not beat both**"
                L.append(f"| {r['arm']} | {r['fetch_all_ms']:.0f} | {r['plan_ms']:.0f} | {r['recompute_ms']:.0f} | "
                         f"{r['plan_vs_best']:.3f} | {ok} | {r['plan_tier_hit_tokens']} | {', '.join(r['plan_reasons'])} |")
            L.append("")
        for k, r in lp.items():
            dt = r.get("disk_throttle")
            if dt:
                L += [f"{k}: d2's reads from disk {dt.get('device')} limited to {dt['read_bps'] / 1e9:.3g} GB/s "
                      f"(cgroup v{dt.get('cgroup_version')} {dt.get('cgroup')}, `{dt.get('limit_line')}`); "
                      f"{_f(None if dt.get('read_bytes') is None else dt['read_bytes'] / 1e9, '{:.2f}')} GB "
                      "read through it in the arm.", ""]
        for k, why in (s.get("plans_skipped") or {}).items():
            L += [f"{k}: {why}", ""]
        for k, r in lp.items():
            if r.get("layers_landed_ms"):
                pct = r.get("landed_vs_pinned_memcpy")
                L.append(f"{k}: every layer landed {r['layers_landed_ms']:.1f} ms after the onload was "
                         f"sent: {r['landed_GBps']:.1f} GB/s"
                         + (f", {pct * 100:.0f} % of pinned memcpy" if pct else "")
                         + " (onload ms ends at OnloadWait, after the prefill).")
        L.append("")
    c = s.get("correctness")
    if isinstance(c, dict) and "error" not in c:
        L += ["## Correctness (onloaded KV vs KV computed in place)", "",
              "| path | tier-hit tokens | KV pages bitwise equal | logits bitwise equal to GPU-cached run | max abs diff vs one-pass recompute | same first token |",
              "|---|---|---|---|---|---|"]
        for k, r in c.items():
            L.append(f"| {k} | {r['tier_hit_tokens']} | {r['kv_pages_bitwise_equal']} | "
                     f"{r['logits_bitwise_equal_to_gpu_cached']} | {r['max_abs_diff_vs_full_recompute']:.3g} "
                     f"(logit scale {r['logit_scale']:.3g}) | {r['first_token_equal_full_recompute']} |")
        L.append("")
    be = s.get("break_even")
    if be:
        fit = s["prefill_fit"]
        L += ["## Break-even (fetch vs recompute)", "",
              f"Prefill model fitted on arm a: {fit['fixed_s'] * 1e3:.1f} ms + {fit['per_token_s'] * 1e6:.1f} µs/token "
              f"+ {fit['per_token_ctx_s'] * 1e9:.3f} ns/token/context-token.", "",
              "| path | GB/s | fixed ms | fetch beats recompute from | gain 8k@50 % hit | 32k@90 % | 2k@25 % |",
              "|---|---|---|---|---|---|---|"]
        for k, r in be.items():
            g = r["ttft_gain_by_len_and_hit"]
            L.append(f"| {k} | {r['GBps']:.1f} | {r['fixed_s'] * 1e3:.2f} | {r['break_even_tokens']} tokens | "
                     f"{g['8192@0.5']:.2f}x | {g['32768@0.9']:.2f}x | {g['2048@0.25']:.2f}x |")
        L.append("")
    eq = s.get("recompute_equivalent_GBps")
    if eq:
        L += ["Recompute-equivalent bandwidth (a path faster than this beats recomputing): " +
              ", ".join(f"{k.replace('_', ' ')} {v:.1f} GB/s" for k, v in eq.items()) + ".", ""]
    if s.get("openloop"):
        L.append(sweep_report.markdown(s["openloop"]))
    if s.get("openloop2"):
        L.append(sweep_report.markdown(s["openloop2"], "two workers, one GPU"))
    return "\n".join(L)


def svg(s: Dict) -> str:
    """Two panels: workload TTFT p50/p90/p99 per arm; long-prefix TTFT per path (log scale)."""
    rows = []
    for key, tag in (("workload", ""), ("workload2", " (2 workers)")):
        w = s.get(key)
        if isinstance(w, dict) and "error" not in w:
            rows += [(arm + tag, r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"]) for arm, r in w.items()]
    lp = [(k, r["ttft_ms"]) for k, r in (s.get("long_prefix") or {}).items() if "ttft_ms" in r]
    W, bar, gap = 900, 14, 10
    h1 = 40 + len(rows) * (3 * bar + gap)
    h2 = 40 + len(lp) * (bar + gap)
    H = h1 + h2 + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="10" y="20" font-size="14">TTFT per arm (ms): p50 / p90 / p99 — {s.get("device") or "cpu"}</text>']
    x0, xw = 170, W - 260
    mx = max([r[3] for r in rows] + [1e-9])
    y = 35
    colors = ("#1f77b4", "#ff7f0e", "#d62728")
    for i, (lab, col) in enumerate(zip(("p50", "p90", "p99"), colors)):
        out.append(f'<rect x="{W - 200 + i * 60}" y="8" width="12" height="12" fill="{col}"/>'
                   f'<text x="{W - 184 + i * 60}" y="19">{lab}</text>')
    for name, *vals in rows:
        out.append(f'<text x="10" y="{y + bar * 2}">{name}</text>')
        for i, v in enumerate(vals):
            w = max(1, v / mx * xw)
            out.append(f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="{bar - 2}" fill="{colors[i]}"/>')
            out.append(f'<text x="{x0 + w + 4:.1f}" y="{y + bar - 3}">{v:.0f}</text>')
            y += bar
        y += gap
    y = h1 + 20
    out.append(f'<text x="10" y="{y}" font-size="14">One long prefix: TTFT (ms, log scale)</text>')
    y += 15
    if lp:
        lo, hi = math.log10(max(min(v for _, v in lp) / 2, 1e-3)), math.log10(max(v for _, v in lp) * 1.2)
        for name, v in lp:
            w = max(1, (math.log10(v) - lo) / (hi - lo) * xw)
            out.append(f'<text x="10" y="{y + bar - 3}">{name}</text>')
            out.append(f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="{bar - 2}" fill="#2ca02c"/>')
            out.append(f'<text x="{x0 + w + 4:.1f}" y="{y + bar - 3}">{v:.0f} ms</text>')
            y += bar + gap
    out.append("</svg>")
    return "\n".join(out)


def main(argv=None) -> int:
    """Re-renders summary.json, report.md and ttft.svg from a results.json."""
    import argparse
    import json
    import os
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import gzip
    opener = gzip.open if a.results.endswith(".gz") else open
    with opener(a.results, "rt") as f:
        s = build(json.load(f))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(markdown(s))
    with open(os.path.join(a.out, "ttft.svg"), "w") as f:
        f.write(svg(s))
    print(markdown(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
