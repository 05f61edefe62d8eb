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
"""

from __future__ import annotations

from typing import Dict, List

from .openloop import OpenLoop, OpenLoopConfig
from .sweep_report import pct
from .workload import WorkloadConfig, generate


def run(worker) -> Dict:
    ol = worker.spec["openloop"]
    reqs = generate(WorkloadConfig(**ol["workload"]))
    if ol.get("requests"):
        reqs = reqs[: ol["requests"]]
    rates, bounds = sorted(ol["rates"]), sorted(ol["bounds_ms"])
    arms = ol["arms"]
    knobs = {k: ol[k] for k in ("decode_tokens", "max_running", "max_prefill_tokens") if k in ol}
    worker.warm_up()
    alive = {a["arm"]: True for a in arms}
    runs: List[Dict] = []
    for ri, rate in enumerate(rates):
        k = ri % len(arms)
        for a in arms[k:] + arms[:k]:
            if not alive[a["arm"]]:
                continue
            tier = dict(a["tier"], ns_name=f"{a['tier']['ns_name']}-r{ri}") if a.get("tier") else None
            lane = worker.lane(f"ol-{a['arm']}-r{ri}", ol["pool_pages"], tier, a.get("layout"))
            print(f"  open loop: arm {a['arm']} at {rate} req/s", flush=True)
            try:
                res = OpenLoop(lane, OpenLoopConfig(rate=rate, seed=ol.get("seed", 1), **knobs)).run(reqs)
                res["finish"] = lane.finish()
                if lane.tier is not None:
                    res["cleared_blocks"] = lane.tier.conn.clear(lane.tier.ns)
            finally:
                worker.close(lane)
            res["arm"] = a["arm"]
            res["p90_ms"] = pct([r["ttft_s"] for r in res["rows"]], 90) * 1e3
            runs.append(res)
            print(f"    p90 TTFT {res['p90_ms']:.0f} ms, {res['achieved_req_per_s']:.2f} req/s done", flush=True)
            if res["p90_ms"] > bounds[-1]:
                alive[a["arm"]] = False
        if not any(alive.values()):
            break
    return {"arms": [a["arm"] for a in arms], "rates": rates, "bounds_ms": bounds, "requests": len(reqs),
            "knobs": knobs, "pool_pages": ol["pool_pages"], "runs": runs}
