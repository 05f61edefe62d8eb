"""Rate sweep per arm: the highest request rate each arm sustains with TTFT p90 under a bound.

`run(worker)` (the worker's `openloop` section): for each rate of the grid, in increasing
order, every arm still under the largest bound serves the same requests with the same
Poisson arrivals (`harness/openloop.py`); the arm that goes first rotates from rate to rate.
Each (rate, arm) run starts cold: a fresh pool and prefix cache, and a namespace of its own
in the daemon, cleared after the run. An arm stops once its TTFT p90 exceeded the largest
bound. `harness/sweep_report.py` turns the runs into: per arm and bound, the sustained rate (the highest
grid rate whose p90 is within the bound, and the rate where p90 crosses the bound,
interpolated linearly between the last passing and the first failing rate); each arm's gain
over the first arm; and TTFT percentiles of all arms at equal rates.

Several workers (spec `workers` > 1, phase 2: arms a2 and c): each worker process serves the
requests i % workers == its index at the whole stream's arrival times, the clocks started
together at a barrier; after each run the workers exchange their rows through files in
`openloop.exchange_dir`, so every worker sees the merged run (TTFT over all requests, rate =
all requests / the slower worker's wall time) and all stop an arm at the same rate.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

from .openloop import OpenLoop, OpenLoopConfig
from .sweep_report import pct
from .workload import WorkloadConfig, generate


def _merge(parts: List[Dict]) -> Dict:
    """One run of several workers (each served its share of the stream) as one run."""
    if len(parts) == 1:
        return parts[0]
    rows = sorted((r for p in parts for r in p["rows"]), key=lambda x: x["arrival_s"])
    wall = max(p["wall_s"] for p in parts)
    out_tokens = sum(r["output_tokens"] for r in rows)
    m = dict(parts[0], rows=rows, wall_s=wall, requests=len(rows),
             achieved_req_per_s=len(rows) / wall if wall else None,
             output_tok_per_s=out_tokens / wall if wall else None)
    m["steps"] = [p["steps"] for p in parts]
    m["finish"] = [p.get("finish") for p in parts]
    m["per_worker"] = [{k: p.get(k) for k in ("wall_s", "requests", "achieved_req_per_s", "decoder")}
                       for p in parts]
    return m


def _exchange(worker, res: Dict, tag: str) -> Dict:
    """With several workers: every worker's result of this run, merged (the same in each)."""
    workers, widx = worker.spec.get("workers", 1), worker.spec.get("worker_index", 0)
    if workers == 1:
        return res
    d = worker.spec["openloop"]["exchange_dir"]
    with open(os.path.join(d, f"{tag}-w{widx}.json"), "w") as f:
        json.dump(res, f, default=str)
    worker.barrier.wait(timeout=900)
    parts = []
    for i in range(workers):
        with open(os.path.join(d, f"{tag}-w{i}.json")) as f:
            parts.append(json.load(f))
    return _merge(parts)


def run(worker) -> Dict:
    ol = worker.spec["openloop"]
    reqs = generate(WorkloadConfig(**ol["workload"]))
    if ol.get("requests"):
        reqs = reqs[: ol["requests"]]
    rates, bounds = sorted(ol["rates"]), sorted(ol["bounds_ms"])
    arms = ol["arms"]
    knobs = {k: ol[k] for k in ("decode_tokens", "max_running", "max_prefill_tokens", "decode", "decode_attn")
             if k in ol}
    workers, widx = worker.spec.get("workers", 1), worker.spec.get("worker_index", 0)
    worker.warm_up()
    alive = {a["arm"]: True for a in arms}
    runs: List[Dict] = []
    for ri, rate in enumerate(rates):
        k = ri % len(arms)
        for a in arms[k:] + arms[:k]:
            if not alive[a["arm"]]:
                continue
            tier = dict(a["tier"], ns_name=f"{a['tier']['ns_name']}-r{ri}") if a.get("tier") else None
            lane = worker.lane(f"ol-{a['arm']}-r{ri}-w{widx}", ol["pool_pages"], tier, a.get("layout"))
            print(f"  open loop: arm {a['arm']} at {rate} req/s (worker {widx}/{workers})", flush=True)
            cfg = OpenLoopConfig(rate=rate, seed=ol.get("seed", 1), workers=workers, worker_index=widx, **knobs)
            try:
                res = OpenLoop(lane, cfg).run(reqs, worker.barrier if workers > 1 else None)
                res["finish"] = lane.finish()
                # Several workers share the arm's namespace: after the exchange all are done.
                res = _exchange(worker, res, f"ol-r{ri}-{a['arm']}")
                if lane.tier is not None and widx == 0:
                    res["cleared_blocks"] = lane.tier.conn.clear(lane.tier.ns)
            finally:
                worker.close(lane)
            res["arm"] = a["arm"]
            res["p90_ms"] = pct([r["ttft_s"] for r in res["rows"]], 90) * 1e3
            runs.append(res)
            print(f"    p90 TTFT {res['p90_ms']:.0f} ms; offered {res['offered_req_per_s']:.2f} req/s, "
                  f"{res['achieved_req_per_s']:.2f} req/s done", flush=True)
            if res["p90_ms"] > bounds[-1]:
                alive[a["arm"]] = False
        if not any(alive.values()):
            break
    return {"arms": [a["arm"] for a in arms], "rates": rates, "bounds_ms": bounds, "requests": len(reqs),
            "knobs": knobs, "pool_pages": ol["pool_pages"], "workers": workers, "runs": runs}
