"""Open-loop sweep results (harness/sweep.py) as numbers and Markdown; no torch needed.

Per arm and TTFT bound: the sustained rate (the highest grid rate whose p90 is within the
bound, and the rate where p90 crosses it, interpolated linearly between the last passing and
the first failing rate); each arm's gain over the first arm at each bound; and TTFT
percentiles of all arms at equal rates.

Rates: a run's nominal rate is the Poisson rate its arrivals were drawn at; its offered rate
is what that draw really offered (requests / last arrival), the same for every arm at one
nominal rate; its achieved rate is requests / wall time. The sustained rates are interpolated
over the offered rates (the nominal grid rate is printed beside them).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional


def pct(xs: List[float], p: float) -> float:
    """Linear-interpolated percentile (as harness/report.py's)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)



def _pcts(rows: List[Dict]) -> Dict:
    t = [r["ttft_s"] for r in rows]
    q = [r["queue_s"] for r in rows]
    return {"ttft_p50_ms": pct(t, 50) * 1e3, "ttft_p90_ms": pct(t, 90) * 1e3, "ttft_p99_ms": pct(t, 99) * 1e3,
            "queue_p50_ms": pct(q, 50) * 1e3,
            "tier_hit": sum(r["tier_hit_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows)),
            "gpu_hit": sum(r["gpu_hit_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))}


def sustained(points: List[tuple], bound: float) -> Dict:
    """`points`: (rate, p90 ms) in increasing rate. The highest rate within the bound before the
    first one over it, and the crossing interpolated between them (None when none passed;
    `saturated` False when no rate exceeded the bound: the true figure is higher)."""
    best, cross, over = None, None, False
    for i, (r, p) in enumerate(points):
        if p > bound:
            over = True
            if best is not None:
                r0, p0 = points[i - 1]
                cross = r0 + (bound - p0) / (p - p0) * (r - r0)
            break
        best = r
    if not over:
        cross = best
    return {"grid": best, "interpolated": cross, "saturated": over}


def _step_ms(steps, kind: str) -> Optional[float]:
    """Mean host-measured time of one step of `kind` (merged runs hold one steps dict per worker)."""
    parts = steps if isinstance(steps, list) else [steps or {}]
    n = sum(p.get(kind, 0) for p in parts)
    t = sum(p.get(f"{kind}_s", 0.0) for p in parts)
    return t / n * 1e3 if n and t else None


def summarize(sw: Dict) -> Dict:
    if not isinstance(sw, dict) or "runs" not in sw:
        return {"error": (sw or {}).get("error", "no open-loop runs")}
    by: Dict[str, List[Dict]] = {a: [] for a in sw["arms"]}
    for r in sw["runs"]:
        steps = r.get("steps")
        parts = steps if isinstance(steps, list) else [steps or {}]
        by[r["arm"]].append({"rate": r["rate"], "offered": r.get("offered_req_per_s") or r["rate"],
                             "achieved": r["achieved_req_per_s"],
                             "output_tok_per_s": r["output_tok_per_s"], "wall_s": r["wall_s"],
                             "decode_step_ms": _step_ms(steps, "decode"),
                             "decode_batch": (sum(p.get("decode_seqs", 0) for p in parts)
                                              / max(1, sum(p.get("decode", 0) for p in parts))),
                             **_pcts(r["rows"])})
    for rows in by.values():
        rows.sort(key=lambda x: x["rate"])
    out: Dict = {"arms": sw["arms"], "bounds_ms": sw["bounds_ms"], "requests": sw["requests"],
                 "knobs": sw.get("knobs", {}), "pool_pages": sw.get("pool_pages"), "by_arm": by,
                 "sustained": {}, "gain": {}}
    for arm, rows in by.items():
        out["sustained"][arm] = {}
        for b in sw["bounds_ms"]:
            x = sustained([(x["offered"], x["ttft_p90_ms"]) for x in rows], b)
            x["nominal"] = next((y["rate"] for y in rows if y["offered"] == x["grid"]), None)
            out["sustained"][arm][str(b)] = x
    ref = sw["arms"][0]
    for arm in sw["arms"][1:]:
        out["gain"][arm] = {}
        for b in map(str, sw["bounds_ms"]):
            x, y = out["sustained"][arm][b]["interpolated"], out["sustained"][ref][b]["interpolated"]
            out["gain"][arm][b] = (x / y - 1) if x and y else None
    rates = sorted({x["rate"] for rows in by.values() for x in rows})
    out["equal_rate"] = [{"rate": r, **{arm: next((x for x in by[arm] if x["rate"] == r), None) for arm in by}}
                         for r in rates]
    return out


def _f(v: Optional[float], fmt: str = "{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def markdown(s: Dict, title: Optional[str] = None) -> str:
    head = "## Open loop: rate sweep (Poisson arrivals, batched prefill, decode)" + (f", {title}" if title else "")
    if "error" in s:
        return f"{head}\n\nerror: {s['error']}\n"
    k = s.get("knobs", {})
    L = [head, "",
         f"{s['requests']} requests per run, decode {k.get('decode_tokens')} tokens "
         f"({k.get('decode', 'eager')} decode), up to {k.get('max_running')} in flight, pool "
         f"{s.get('pool_pages')} pages. Sustained rate = highest offered request rate with TTFT p90 "
         "within the bound (the grid run's offered rate [nominal] / interpolated where p90 crosses it; "
         "'≥' = never crossed).", "",
         "| arm | " + " | ".join(f"req/s at p90 ≤ {b:g} ms" for b in s["bounds_ms"]) + " | " +
         " | ".join(f"gain at {b:g} ms" for b in s["bounds_ms"]) + " |",
         "|---|" + "---|" * (2 * len(s["bounds_ms"]))]
    for arm in s["arms"]:
        cells = []
        for b in map(str, s["bounds_ms"]):
            x = s["sustained"][arm][b]
            pre = "" if x["saturated"] else "≥ "
            cells.append(f"{pre}{_f(x['grid'], '{:.2f}')} [{_f(x.get('nominal'), '{:g}')}] / "
                         f"{pre}{_f(x['interpolated'], '{:.2f}')}" if x["grid"] else "none")
        gains = [_f(None if arm not in s["gain"] or s["gain"][arm][b] is None else s["gain"][arm][b] * 100, "{:+.0f} %")
                 for b in map(str, s["bounds_ms"])]
        L.append(f"| {arm} | " + " | ".join(cells) + " | " + " | ".join(gains) + " |")
    L += ["", "TTFT at equal rate (nominal req/s (offered); per arm: ms p50 / p90 / p99; queue p50; "
          "achieved req/s; decode step ms × mean batch):", "",
          "| req/s | " + " | ".join(s["arms"]) + " |", "|---|" + "---|" * len(s["arms"])]
    for row in s["equal_rate"]:
        cells, offered = [], None
        for arm in s["arms"]:
            x = row.get(arm)
            if x is not None:
                offered = x.get("offered")
            cells.append("" if x is None else
                         f"{x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f} / {x['ttft_p99_ms']:.0f}; "
                         f"q {x['queue_p50_ms']:.0f}; {x['achieved']:.2f}; "
                         f"{_f(x.get('decode_step_ms'), '{:.1f}')} × {_f(x.get('decode_batch'), '{:.1f}')}")
        L.append(f"| {row['rate']:g} ({_f(offered, '{:.2f}')}) | " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"
