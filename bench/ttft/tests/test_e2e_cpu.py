"""The whole harness, tiny CPU configuration, against real daemons (DRAM, NVMe spill dir, two peers).

Without CUDA the pages move through Put/inline Get instead of the daemon's DMA (CopyMover);
everything else — hashing, GPU prefix cache, lookup, hinted peer pulls, async offload,
interleaved arms, two lockstep worker processes, the report — is the code the GPU run uses.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def tiny_run_end_to_end_reuses_kv_from_every_tier_and_loads_the_right_bytes(kvnode_bin, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, KVNODE_BIN=kvnode_bin,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "bench", "ttft")]))
    # Two filler prompts before each NVMe rep: one pushes only part of the prefix out of the
    # 8 MiB DRAM tier (30 of its 32 pages), two push all of it, so every rep reads it all back.
    p = subprocess.run([sys.executable, "-m", "harness.run", "--profile", "tiny", "--out", str(out),
                        "--spill-root", str(tmp_path / "spill"), "--set", "long_prefix.nvme_filler=2"],
                       cwd=os.path.join(ROOT, "bench", "ttft"), env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["errors"] == []
    c = s["correctness"]
    for path in ("dram", "peer"):
        assert c[path]["tier_hit_tokens"] > 0, path
        assert c[path]["kv_pages_bitwise_equal"] and c[path]["logits_bitwise_equal_to_gpu_cached"], path
    w = s["workload"]
    assert w["a"]["hit_dram"] == 0 and w["a"]["computed_share"] > w["b"]["computed_share"]
    assert w["b"]["hit_dram"] > 0 and w["b"]["first_token_agreement"] == 1.0
    assert w["d"]["hit_dram"] + w["d"]["hit_nvme"] > 0
    assert w["e"]["hit_peer"] > 0
    w2 = s["workload2"]
    assert w2["c"]["requests"] == w2["a2"]["requests"] > 0
    assert w2["c"]["hit_dram"] > 0
    lp = s["long_prefix"]
    assert lp["dram"]["tier_hit_tokens"] == 512 and lp["recompute"]["tier_hit_tokens"] == 0
    assert lp["peer"]["pulled_tokens"] > 0
    # Read back from the spill dir. Not asserted whole: with an 8 MiB DRAM tier a promotion can
    # find no room while two chunks are leased, which ends the usable prefix there.
    assert lp["nvme"]["tier_hit_tokens"] > 0
    # Every rep (the median's included) read the whole prefix back from NVMe, not only the
    # first rep and not only some of its pages: 512 tokens of 16-token pages.
    per_rep = lp["nvme"]["promoted_pages_per_rep"]
    assert per_rep == [512 // 16] * 2, f"NVMe reps promoted {per_rep} pages, want the whole 32-page prefix each"
    for f in ("report.md", "ttft.svg", "results.json", "daemon-d1.log"):
        assert (out / f).exists(), f


def tiny_open_loop_sweeps_one_worker_and_two_workers_with_the_engine_like_decode(kvnode_bin, tmp_path):
    """Section openloop in both phases: arms a/b (one worker), a2/c (two worker processes that
    split the stream and merge their rows); decode through harness/decode.py."""
    out = tmp_path / "out"
    env = dict(os.environ, KVNODE_BIN=kvnode_bin,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "bench", "ttft")]))
    p = subprocess.run([sys.executable, "-m", "harness.run", "--profile", "tiny", "--out", str(out),
                        "--spill-root", str(tmp_path / "spill"), "--sections", "openloop", "--phases", "1,2",
                        # a pool small enough that the stream's history is evicted and read back
                        "--set", "openloop.pool_pages=14"],
                       cwd=os.path.join(ROOT, "bench", "ttft"), env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["errors"] == []
    r = json.loads((out / "results.json").read_text())
    n = r["phase1"]["openloop"]["requests"]
    for key, arms, tier_arm in (("openloop", ("a", "b"), "b"), ("openloop2", ("a2", "c"), "c")):
        ol = s[key]
        assert ol["arms"] == list(arms)
        for arm in arms:
            rows = ol["by_arm"][arm]
            assert rows and all(x["offered"] > 0 and x["decode_step_ms"] for x in rows), (key, arm)
        assert all(x["tier_hit"] > 0 for x in ol["by_arm"][tier_arm]), key
        assert all(x["tier_hit"] == 0 for x in ol["by_arm"][arms[0]]), key
    w0, w1 = r["phase2"]
    for run in w0["openloop"]["runs"]:
        # The merged run holds both workers' requests: the whole stream, each request once.
        assert sorted(x["idx"] for x in run["rows"]) == list(range(n)), run["arm"]
        assert [p["requests"] for p in run["per_worker"]] == [(n + 1) // 2, n // 2]
        assert run["decoder"]["attn"] == "sdpa" and run["decoder"]["graphs"] is False
    assert [x["p90_ms"] for x in w0["openloop"]["runs"]] == [x["p90_ms"] for x in w1["openloop"]["runs"]]
