"""Orchestrates a TTFT run: starts the daemons, runs the worker phases, writes results and report.

Phase 1 (one worker process): memcpy reference, correctness, the long prefix, and the
workload with arms a (GPU prefix cache only), b (kvnode DRAM, CUDA DMA), d (kvnode with a
small DRAM tier over NVMe) and e (two workers on two daemons, peer pulls by router hint),
interleaved request by request.
Phase 2 (two worker processes): arms a2 (GPU only, each worker its own cache) and c (both
workers on one daemon namespace), the same request stream split round-robin between the
workers; section workload in lockstep per request, section openloop (when --sections names
it) as two open-loop servers started together, each taking its half of the arrivals.

Usage (from bench/ttft):  python -m harness.run --profile h200 --out DIR
                          python -m harness.run --profile tiny --out DIR     (CPU, no CUDA)
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from . import report
from .daemons import Daemon, DaemonError, find_bin, write_cluster_key
from .throttle import DiskThrottle, Link, ThrottleError

PROFILES: Dict[str, Dict] = {
    "h200": {
        "model": "qwen3-8b", "device": "cuda:0", "mover": "dma", "layout": "layer_first",
        "pool_pages": 384,  # 24k tokens of GPU prefix cache per worker; the working set is 4.5x that
        "workload": {"seed": 1, "vocab": 151936, "page_size": 64, "sys_len": 512, "docs": 6,
                     "doc_len": 4096, "doc_prob": 0.5, "sessions": 24, "turns": 4,
                     "user_len": 512, "answer_len": 512},
        "long_prefix": {"tokens": 32768, "suffix": 64, "reps": 3, "nvme_filler": 1, "peer_reps": 2,
                        # Fetch plans (issue 41), `--set long_prefix.plans=true`: each slow path
                        # fetched whole, planned, and beside recompute; the peer behind a link
                        # shaped to `peer_throttle` (harness/throttle.py; root only).
                        "plans": False, "mixed_dram_frac": 0.5, "peer_throttle": "8gbit",
                        # The slow-disk mixed arm: d2's reads from its disk held to this many
                        # bytes/s by a cgroup for those arms only (harness/throttle.py; root only).
                        "mixed_slow_read_bps": 1.2e9},
        "correctness": {"prefix_pages": 40, "suffix": 100},
        # d1 holds arms b, b_pf, c (15.3 GiB each) and the long prefix. d2's slab holds exactly
        # 4 pages of 9 MiB: with the default 64 MiB slab the daemon's spill set-up panics (its
        # region clamp has min > max; reported to the lead).
        "daemons": {"d1": "52GiB", "d2": "3GiB", "d2_spill": "40GiB", "ea": "16GiB", "eb": "16GiB",
                    "d2_extra": ["--slab-size", "36MiB"], "ta": "6GiB", "tb": "6GiB"},
        "memcpy_bytes": 4 << 30,
        "chunk_pages": 64,
        # Section openloop (harness/sweep.py): the same traffic, Poisson arrivals, a rate sweep.
        # The pool holds 8 requests in flight (prompts up to 8k tokens + decode): 48k tokens,
        # still 2.3x less than the 111k-token working set.
        "openloop": {"workload": {"seed": 1, "vocab": 151936, "page_size": 64, "sys_len": 512, "docs": 6,
                                  "doc_len": 4096, "doc_prob": 0.5, "sessions": 24, "turns": 4,
                                  "user_len": 512, "answer_len": 512},
                     "seed": 1, "rates": [2, 3, 4, 5, 6, 7, 8, 10, 12, 14], "bounds_ms": [500, 1000],
                     "decode_tokens": 32, "max_running": 8, "max_prefill_tokens": 16384, "decode": "graph",
                     "pool_pages": 768, "arm_names": ["a", "b"]},
    },
    "tiny": {
        "model": "tiny", "device": "cpu", "mover": "copy", "layout": "layer_first",
        "pool_pages": 16,
        "workload": {"seed": 1, "vocab": 512, "page_size": 16, "sys_len": 32, "docs": 2,
                     "doc_len": 64, "doc_prob": 0.75, "sessions": 6, "turns": 3,
                     "user_len": 16, "answer_len": 16},
        "long_prefix": {"tokens": 512, "suffix": 16, "reps": 2, "nvme_filler": 1, "peer_reps": 1,
                        "plans": False, "mixed_dram_frac": 0.5, "peer_throttle": None,
                        "mixed_slow_read_bps": 1.2e9},
        "correctness": {"prefix_pages": 6, "suffix": 10},
        # A DRAM tier of a few small slabs over the spill dir, so the NVMe arm really promotes;
        # psync because CI temp dirs may be tmpfs (no O_DIRECT).
        "daemons": {"d1": "256MiB", "d2": "8MiB", "d2_spill": "256MiB", "ea": "128MiB", "eb": "128MiB",
                    "d2_extra": ["--slab-size", "1MiB", "--spill-engine", "psync"], "ta": "128MiB", "tb": "128MiB"},
        "chunk_pages": 8,
        "memcpy_bytes": 0,
        "openloop": {"workload": {"seed": 1, "vocab": 512, "page_size": 16, "sys_len": 32, "docs": 2,
                                  "doc_len": 64, "doc_prob": 0.75, "sessions": 4, "turns": 3,
                                  "user_len": 16, "answer_len": 16},
                     "seed": 1, "rates": [5, 5000], "bounds_ms": [2000], "decode_tokens": 2, "decode": "graph",
                     "max_running": 4, "max_prefill_tokens": 512, "pool_pages": 64, "arm_names": ["a", "b"]},
    },
}


def _stats(d: Daemon) -> Dict:
    try:
        out = subprocess.run([d.bin, "stats", "--json", "--socket", d.sock], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        s = json.loads(out).get("stats", {})
        return {"tiers": s.get("tiers"), "gpu": s.get("gpu"), "costs": s.get("costs"), "plans": s.get("plans")}
    except Exception as e:  # noqa: BLE001 - stats are informative only
        return {"error": str(e)}


def _wait_registered(daemons) -> Dict[str, float]:
    """Waits until every daemon's arena is registered with CUDA, so copies run pinned from the start."""
    from kvnode.gpu import GpuClient
    from kvnode.wire import Connection
    out = {}
    t0 = time.perf_counter()
    for d in daemons:
        c = Connection(d.sock, client="ttft-wait")
        try:
            GpuClient(c).wait_registered(timeout_s=400)
        finally:
            c.close()
        out[d.name] = time.perf_counter() - t0
    return out


def _spawn(specs: List[Dict], outdir: str, tag: str) -> List[Dict]:
    from .worker import run as worker_run
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(specs)) if len(specs) > 1 else None
    procs, outs = [], []
    for i, s in enumerate(specs):
        out = os.path.join(outdir, f"{tag}-w{i}.json")
        outs.append(out)
        p = ctx.Process(target=worker_run, args=(s, out, barrier))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    res = []
    for p, out in zip(procs, outs):
        try:
            with open(out) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            r = {"error": f"worker wrote no result ({e}); exit code {p.exitcode}"}
        r["exitcode"] = p.exitcode
        res.append(r)
    return res


def _phase1_spec(prof: Dict, sections: List[str], common: Dict, tier, nlayers: int) -> Dict:
    """The single worker's spec: every phase-1 section's paths and arms (`tier` builds a tier spec)."""
    lp = prof["long_prefix"]
    wl = {"config": prof["workload"], "pool_pages": prof["pool_pages"]}
    spec = dict(common, sections=sections, workers=1, worker_index=0)
    spec["correctness"] = dict(prof["correctness"], paths=[
        ["dram", tier("d1", "dram", "corr"), tier("d1", "dram", "corr")],
        ["dram_layerwise", tier("d1", "dram", "corr-lw"), tier("d1", "dram", "corr-lw", layers=nlayers)],
        ["peer", tier("ea", "peer", "corr"), tier("eb", "peer", "corr")],
    ])
    spec["long_prefix"] = {"tokens": lp["tokens"], "suffix": lp["suffix"], "reps": lp["reps"], "paths": [
        {"name": "dram", "kind": "dram", "tier": tier("d1", "dram", "long")},
        {"name": "dram_page_first", "kind": "dram", "layout": "page_first",
         "tier": tier("d1", "dram", "long-pf")},
        {"name": "dram_layerwise", "kind": "dram", "tier": tier("d1", "dram", "long-lw", layers=nlayers)},
        {"name": "nvme", "kind": "nvme", "tier": tier("d2", "nvme", "long"),
         "filler_prompts": lp["nvme_filler"]},
        {"name": "peer", "kind": "peer", "reps": lp["peer_reps"],
         "source": tier("ea", "peer", "long"), "tier": tier("eb", "peer", "long")},
    ]}
    if prof["mover"] != "copy":
        # Pulled pages streamed into the GPU as they land (one hinted OnloadAsync); needs
        # the daemon's DMA, so not in the CPU profile (tests/test_peer_stream_fake_gpu.py
        # covers it on CPU with the fake GPU).
        spec["correctness"]["paths"].append(
            ["peer_stream", tier("ea", "peer", "corr-st"), tier("eb", "peer", "corr-st", stream_pull=True)])
        spec["long_prefix"]["paths"].append(
            {"name": "peer_stream", "kind": "peer", "reps": lp["peer_reps"],
             "source": tier("ea", "peer", "long-st"),
             "tier": tier("eb", "peer", "long-st", stream_pull=True)})
    if lp.get("plans"):
        # Fetch or recompute (issue 41): each slow path fetched whole and with a plan (the
        # recompute row is the third arm). NVMe: the prefix on the host's disk. Mixed: its
        # leading `mixed_dram_frac` back in DRAM, the rest on the disk. Slow peer: a source
        # daemon behind a shaped link (skipped, with the reason, where it cannot be made).
        nv = dict(kind="nvme", filler_prompts=lp["nvme_filler"])
        mix = dict(nv, dram_frac=lp["mixed_dram_frac"])
        spec["long_prefix"]["paths"] += [
            dict(nv, name="nvme_plan", plan=True, tier=tier("d2", "nvme", "long")),
            dict(mix, name="mixed", tier=tier("d2", "nvme", "long")),
            dict(mix, name="mixed_plan", plan=True, tier=tier("d2", "nvme", "long")),
        ]
        if getattr(tier, "disk_throttle", None):
            # Mixed on a slow disk: the same, with d2's disk reads limited by a cgroup while
            # these two arms run (the worker sets it up and removes it around each).
            spec["long_prefix"]["paths"] += [
                dict(mix, name="mixed_slow", tier=tier("d2", "nvme", "long"), disk_throttle=tier.disk_throttle),
                dict(mix, name="mixed_slow_plan", plan=True, tier=tier("d2", "nvme", "long"),
                     disk_throttle=tier.disk_throttle),
            ]
        spec["long_prefix"]["mixed_dram_frac"] = lp["mixed_dram_frac"]  # the cost fit's tail
        if "tb" in tier.daemons:
            slow = dict(kind="peer", reps=lp["peer_reps"], source=tier("ta", "peer", "long-slow"))
            spec["long_prefix"]["paths"] += [
                dict(slow, name="peer_slow", tier=tier("tb", "peer", "long-slow")),
                dict(slow, name="peer_slow_plan", plan=True, tier=tier("tb", "peer", "long-slow-plan"),
                     source=tier("ta", "peer", "long-slow-plan")),
            ]
        if lp.get("plan_cost"):
            spec["long_prefix"]["plan_cost"] = lp["plan_cost"]
        spec["long_prefix"]["skipped"] = dict(tier.skipped)
    # `--set 'long_prefix.only=["dram","dram_layerwise"]'` (likewise correctness.only): run only
    # the named paths, e.g. a copy-path comparison without the slow NVMe and peer rows.
    for sec, only in (("long_prefix", lp.get("only")), ("correctness", prof["correctness"].get("only"))):
        if only:
            keep = [p for p in spec[sec]["paths"] if (p["name"] if isinstance(p, dict) else p[0]) in only]
            spec[sec]["paths"] = keep
    spec["workload"] = dict(wl, arms=[
        {"arm": "a", "lanes": [{"name": "a"}]},
        {"arm": "b", "lanes": [{"name": "b", "tier": tier("d1", "dram", "wl-b")}]},
        {"arm": "b_pf", "lanes": [{"name": "b_pf", "layout": "page_first",
                                   "tier": tier("d1", "dram", "wl-b-pf")}]},
        {"arm": "d", "lanes": [{"name": "d", "tier": tier("d2", "nvme", "wl-d")}]},
        {"arm": "e", "lanes": [{"name": "eA", "tier": tier("ea", "peer", "wl-e")},
                               {"name": "eB", "tier": tier("eb", "peer", "wl-e")}]},
    ])
    ol = dict(prof["openloop"])
    arm_defs = {"a": {"arm": "a"}, "b": {"arm": "b", "tier": tier("d1", "dram", "ol-b")},
                "b_pf": {"arm": "b_pf", "layout": "page_first", "tier": tier("d1", "dram", "ol-b-pf")},
                "b_lw": {"arm": "b_lw", "tier": tier("d1", "dram", "ol-b-lw", layers=nlayers)}}
    ol["arms"] = [arm_defs[n] for n in ol.pop("arm_names")]
    spec["openloop"] = ol
    return spec


def _phase2_specs(prof: Dict, sections: List[str], common: Dict, tier, exchange: str) -> List[Dict]:
    """The two workers' specs: arms a2 and c (closed-loop workload, open-loop sweep)."""
    wl = {"config": prof["workload"], "pool_pages": prof["pool_pages"]}
    specs = []
    for i in range(2):
        s = dict(common, sections=sections, workers=2, worker_index=i)
        s["workload"] = dict(wl, arms=[
            {"arm": "a2", "lanes": [{"name": "a2"}]},
            {"arm": "c", "lanes": [{"name": "c", "tier": tier("d1", "dram", "wl-c")}]},
        ])
        ol2 = {k: v for k, v in prof["openloop"].items() if k != "arm_names"}
        s["openloop"] = dict(ol2, exchange_dir=exchange, arms=[
            {"arm": "a2"}, {"arm": "c", "tier": tier("d1", "dram", "ol-c")}])
        specs.append(s)
    return specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="h200")
    ap.add_argument("--out", required=True, help="directory for results.json, report.md, ttft.svg, daemon logs")
    ap.add_argument("--kvnode-bin", default=None, help="daemon binary (default $KVNODE_BIN)")
    ap.add_argument("--phases", default="1,2", help="which phases to run (1, 2 or 1,2)")
    ap.add_argument("--sections", default="memcpy,correctness,long_prefix,workload",
                    help="phase-1 sections (also: openloop, the open-loop rate sweep)")
    ap.add_argument("--spill-root", default=None, help="directory for the NVMe tier (not tmpfs: O_DIRECT)")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=JSON",
                    help="override a profile value, e.g. workload.sessions=8 or pool_pages=64")
    a = ap.parse_args(argv)
    prof = copy.deepcopy(PROFILES[a.profile])
    for kv in a.set:
        path, _, val = kv.partition("=")
        node = prof
        *head, last = path.split(".")
        for h in head:
            node = node[h]
        node[last] = json.loads(val)
    binp = find_bin(a.kvnode_bin)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvnode-ttft-")
    spill = a.spill_root or os.path.join(work, "spill")
    key = write_cluster_key(os.path.join(work, "cluster.key"))
    base = 20000 + (os.getpid() % 2000) * 2
    ep_a, ep_b = f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"
    dz = prof["daemons"]
    daemons = {
        "d1": Daemon("d1", binp, work, dz["d1"]),
        "d2": Daemon("d2", binp, work, dz["d2"], spill_dir=os.path.join(spill, "d2"), spill_size=dz["d2_spill"],
                     extra=list(dz.get("d2_extra", []))),
        "ea": Daemon("ea", binp, work, dz["ea"], peer_listen=ep_a, cluster_key=key, peers=[f"tcp://{ep_b}"]),
        "eb": Daemon("eb", binp, work, dz["eb"], peer_listen=ep_b, cluster_key=key, peers=[f"tcp://{ep_a}"]),
    }
    lp = prof["long_prefix"]
    skipped: Dict[str, str] = {}
    link = None
    if lp.get("plans"):
        if not lp.get("peer_throttle"):
            skipped["peer_slow"] = "no peer_throttle rate in the profile"
        else:
            try:
                link = Link(rate=lp["peer_throttle"], burst=lp.get("peer_throttle_burst") or "4mb").up()
            except (ThrottleError, OSError) as e:
                skipped["peer_slow"] = f"no shaped link: {e}"
        if link is not None:
            pt, pu = base + 2, base + 3
            daemons["ta"] = Daemon("ta", binp, work, dz["ta"], peer_listen=f"{link.ns_addr}:{pt}", cluster_key=key,
                                   peers=[f"tcp://{link.host_addr}:{pu}"], wrap=link.wrap)
            daemons["tb"] = Daemon("tb", binp, work, dz["tb"], peer_listen=f"{link.host_addr}:{pu}", cluster_key=key,
                                   peers=[f"tcp://{link.ns_addr}:{pt}"])
    results: Dict = {"profile": a.profile, "config": prof, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "kvnode_bin": binp, "argv": sys.argv}
    try:
        for name, d in daemons.items():
            try:
                d.start()
            except DaemonError as e:
                if name != "d2" or "--spill-engine" in d.extra:
                    raise
                # No O_DIRECT on the spill file system (tmpfs, overlayfs): the portable engine.
                results["d2_uring_error"] = str(e)[-500:]
                d.extra += ["--spill-engine", "psync"]
                d.start()
        disk_throttle = None
        only = lp.get("only")
        if lp.get("plans") and (not only or "mixed_slow" in only or "mixed_slow_plan" in only):
            # Can d2's disk reads be limited here? Tried once (set up and removed at once);
            # where not, the slow-disk arms are reported skipped with the reason.
            d2 = daemons["d2"]
            if not lp.get("mixed_slow_read_bps"):
                skipped["mixed_slow"] = "no mixed_slow_read_bps in the profile"
            else:
                try:
                    probe = DiskThrottle(d2.proc.pid, d2.spill_dir, lp["mixed_slow_read_bps"]).up()
                    results["disk_throttle"] = dict(probe.describe(), daemon="d2", pid=d2.proc.pid)
                    probe.down()
                    disk_throttle = {"pid": d2.proc.pid, "path": d2.spill_dir,
                                     "read_bps": lp["mixed_slow_read_bps"]}
                except (ThrottleError, OSError) as e:
                    skipped["mixed_slow"] = f"no disk throttle: {e}"
        if prof["mover"] == "dma":
            results["registration_s"] = _wait_registered(daemons.values())
        results["daemon_args"] = {k: d.args()[1:] for k, d in daemons.items()}
        def tier(d, kind, ns, **kw):
            return {"sock": daemons[d].sock, "kind": kind, "ns_name": ns, "endpoint": daemons[d].endpoint,
                    "chunk_pages": prof["chunk_pages"], **kw}
        tier.daemons, tier.skipped = daemons, skipped  # what the plan paths may use
        tier.disk_throttle = disk_throttle
        if link is not None:
            results["peer_link"] = link.describe()
        common = {k: prof[k] for k in ("model", "device", "mover", "layout", "memcpy_bytes")}
        from .model import CONFIGS
        nlayers = CONFIGS[prof["model"]].layers  # layer-wise onload: one run per model layer
        if "1" in a.phases.split(","):
            spec = _phase1_spec(prof, a.sections.split(","), common, tier, nlayers)
            results["phase1"] = _spawn([spec], a.out, "phase1")[0]
            results["daemon_stats_after_phase1"] = {k: _stats(d) for k, d in daemons.items()}
        p2_sections = [x for x in a.sections.split(",") if x in ("workload", "openloop")]
        if "2" in a.phases.split(",") and p2_sections:
            exchange = os.path.join(work, "ol-exchange")
            os.makedirs(exchange, exist_ok=True)
            specs = _phase2_specs(prof, p2_sections, common, tier, exchange)
            results["phase2"] = _spawn(specs, a.out, "phase2")
            results["daemon_stats_after_phase2"] = {k: _stats(d) for k, d in daemons.items()}
    finally:
        for d in daemons.values():
            d.stop()
        for d in daemons.values():
            try:
                shutil.copy(d.log, os.path.join(a.out, f"daemon-{d.name}.log"))
            except OSError:
                pass
        if link is not None:
            results.setdefault("peer_link", {})["after"] = link.describe()
            link.down()
        shutil.rmtree(spill, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    summary = report.build(results)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(report.markdown(summary))
    with open(os.path.join(a.out, "ttft.svg"), "w") as f:
        f.write(report.svg(summary))
    print(report.markdown(summary))
    return 0 if report.ok(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
