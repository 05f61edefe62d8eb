#!/usr/bin/env bash
# Issue 41 §5 (fetch or recompute) on the lent GPU machine, in ONE call: the long prefix (32k
# tokens + 64) with the plan arms beside fetch-all and recompute, and the DRAM arms unchanged.
#   NVMe:   the prefix on the host's disk (d2: 3 GiB DRAM over the spill dir), read back whole
#           (nvme), and with the daemon's plan (nvme_plan);
#   mixed:  its leading half back in d2's DRAM, the rest on the disk (mixed, mixed_plan);
#           and the same with d2's disk reads limited by a cgroup to long_prefix.mixed_slow_read_bps
#           (1.2e9 B/s by default; mixed_slow, mixed_slow_plan; harness/throttle.py DiskThrottle);
#   peer:   a source daemon in a network namespace behind a veth shaped by tc tbf to 8 Gbit/s
#           (peer_slow: hinted pulls of the whole prefix, peer_slow_plan);
#   the engine's recompute cost is fitted in the run (harness/worker.py: _fit_cost).
# Runs from a directory D holding bench/ttft, clients/python, scripts/bench-ttft.sh and
# bin/kvnode(.gz) (a stripped release build of the branch with the daemon's plans).
# RUNS="1 2" runs it twice (each with fresh daemons). Output: $OUT/plans.log, $OUT/plans.tgz
# (per run report.md, summary.json, results.json, console log; repacked after each run).
set -u -o pipefail
D=$(cd "$(dirname "$0")/../.." && pwd)
R=/tmp/issue41
mkdir -p "$R"
LOG=$OUT/plans.log
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
pack() { (cd "$R" && tar czf "$OUT/plans.tgz.part" --exclude='daemon-*.log' --exclude='ddtest' . && mv "$OUT/plans.tgz.part" "$OUT/plans.tgz"); }
for f in "$D"/bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x "$D"/bin/*
say "host"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2
  "$D/bin/kvnode" --version; df -h /tmp | tail -1; ip -V; tc -V; } 2>&1 | tee -a "$LOG"
say "the disk under the spill dir, O_DIRECT, 2 GiB"
{ dd if=/dev/zero of="$R/ddtest" bs=16M count=128 oflag=direct conv=fsync 2>&1 | tail -1
  dd if="$R/ddtest" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1; rm -f "$R/ddtest"; } | tee -a "$LOG"
A=(--phases 1 --sections memcpy,long_prefix --set long_prefix.plans=true
   --set 'daemons.d1="16GiB"' --set 'daemons.ea="1GiB"' --set 'daemons.eb="1GiB"' --set 'daemons.d2_spill="24GiB"'
   --set 'long_prefix.only=["dram","dram_page_first","dram_layerwise","nvme","nvme_plan","mixed","mixed_plan","mixed_slow","mixed_slow_plan","peer_slow","peer_slow_plan"]')
for run in ${RUNS:-1}; do
  say "long prefix with plans, run $run"
  KVNODE_BIN=$D/bin/kvnode OUT=$R/$run bash "$D/scripts/bench-ttft.sh" h200 "${A[@]}" "$@" > "$R/$run.console" 2>&1
  say "run $run rc=$?"
  sed -n '/^## One long prefix/,/^## Correctness\|^Recompute-equivalent/p' "$R/$run/report.md" 2>/dev/null | tee -a "$LOG"
  python3 - "$R/$run/results.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))
for d, st in (r.get("daemon_stats_after_phase1") or {}).items():
    print(d, "costs", json.dumps(st.get("costs")), "plans", json.dumps(st.get("plans")))
lp = r["phase1"].get("long_prefix") or {}
for k, v in lp.items():
    if isinstance(v, dict) and v.get("plans"):
        print(k, "plans per rep", json.dumps([{x: (p or {}).get(x) for x in ("reason", "keys", "available", "cut_by", "fetch_s", "recompute_s", "runs")} for p in v["plans"]]))
    if isinstance(v, dict) and "promoted_pages_per_rep" in v:
        print(k, "promoted_pages_per_rep", v["promoted_pages_per_rep"])
print("plan_cost", json.dumps(lp.get("plan_cost")))
# GPU memory each arm left behind (its lanes closed and pools freed: about the model's weights),
# and lanes still open after the section (should be none).
print("gpu_allocated_after_GiB", {k: round(v["gpu_allocated_after_bytes"] / 2**30, 2) for k, v in lp.items()
                                  if isinstance(v, dict) and "gpu_allocated_after_bytes" in v},
      "lanes_open_after", lp.get("lanes_open_after"))
print("peer_link", json.dumps(r.get("peer_link"))[:1500])
print("disk_throttle", json.dumps(r.get("disk_throttle")),
      {k: (lp.get(k) or {}).get("disk_throttle") for k in ("mixed_slow", "mixed_slow_plan")},
      {k: v for k, v in lp.items() if k.endswith("_skipped")})
PY
  pack
done
say "done"; pack
