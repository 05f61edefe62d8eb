#!/usr/bin/env bash
# Issue 44's GPU runs, as sent to the lent GPU machine (one call per part; see docs/ttft.md).
# Runs from a directory D holding bench/ttft, clients/python, scripts/bench-ttft.sh and a
# stripped release `kvnode` (the carried copy of this checkout): D/bench/ttft/device-issue44.sh PART
#   PART 1: environment, same-run memcpy, decode step benchmark, open-loop sweeps decode 8 and 32
#           (arms a, b; workload and arrival seed 1)
#   PART 2: decode 8: seed 1, workload + arrival seed 2, two workers (a2, c), seed 1
#   PART 3: decode step with the fused kernels; decode 128 (seed 1); decode 32 at 2 req/s
# Output: $OUT/p<PART>.tgz (every run's report.md, summary.json, results.json.gz, logs), $OUT/p<PART>.log
set -u -o pipefail
D=$(cd "$(dirname "$0")/../.." && pwd)
PART=${1:?usage: device-issue44.sh 1|2|2h|3|3q}
export KVNODE_BIN=$D/kvnode
R=/tmp/issue44
mkdir -p "$R"
LOG=$OUT/p$PART.log
pack() { (cd "$R" && tar czf "$OUT/p$PART.tgz" --exclude='daemon-*.log' . ) ; }
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
# The open-loop profile of the 2026-12-02 full-stream sweep: 96 requests, a 448-page pool, 4 in
# flight (working set ~4x the pool), one daemon with 24 GiB DRAM; small other daemons.
S=(--sections openloop --set 'daemons.d1="24GiB"' --set 'daemons.ea="1GiB"' --set 'daemons.eb="1GiB"'
   --set 'daemons.d2_spill="2GiB"' --set openloop.requests=96 --set openloop.pool_pages=448
   --set openloop.max_running=4)
sweep() {  # name, extra args...
  local name=$1; shift
  say "sweep $name: $*"
  OUT=$R/$name bash "$D/scripts/bench-ttft.sh" h200 "${S[@]}" "$@" > "$R/$name.console" 2>&1
  say "sweep $name rc=$?"; tail -n 40 "$R/$name/report.md" 2>/dev/null | tee -a "$LOG"; pack
}
case "$PART" in
  1)
    say "host"; { nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)';
                  "$KVNODE_BIN" --version; nproc; free -g; } 2>&1 | tee -a "$LOG"
    say "decode bench"
    (cd "$D/bench/ttft" && PYTHONUNBUFFERED=1 PYTHONPATH=$D/clients/python:$D/bench/ttft \
      python3 -m harness.decode_bench --out "$R/decode") 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; pack
    [ "$rc" = 0 ] || { say "decode bench failed: no sweeps"; exit 1; }
    sweep d8-s1 --phases 1 --set openloop.decode_tokens=8 --set 'openloop.rates=[4,6,8,11,15]'
    sweep d32-s1 --phases 1 --set openloop.decode_tokens=32 --set 'openloop.rates=[3,4.5,6,8,11]'
    ;;
  2)  # (the H100 of part 1 was not lent again: this part ran on an H200, with its own seed-1 baseline)
    say "host"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
    say "decode bench, fused kernels too"
    (cd "$D/bench/ttft" && PYTHONUNBUFFERED=1 PYTHONPATH=$D/clients/python:$D/bench/ttft \
      python3 -m harness.decode_bench --out "$R/decode-fused" --fused --batches 1,4,16 --contexts 1024,8192) 2>&1 | tee -a "$LOG"
    pack
    sweep d8-s1 --phases 1 --set openloop.decode_tokens=8 --set 'openloop.rates=[3,5,8,11,15]'
    sweep d8-s2 --phases 1 --set openloop.decode_tokens=8 --set openloop.seed=2 \
      --set openloop.workload.seed=2 --set 'openloop.rates=[4,7,11,15]'
    sweep d8-s1-2w --phases 2 --set openloop.decode_tokens=8 --set 'openloop.rates=[4,7,11,15]'
    ;;
  2h)  # on the H100 of part 1: the other seed, two workers, and decode 8 at 3 req/s
    sweep d8-s2 --phases 1 --set openloop.decode_tokens=8 --set openloop.seed=2 \
      --set openloop.workload.seed=2 --set 'openloop.rates=[3,5,8,11,15]'
    sweep d8-s1-2w --phases 2 --set openloop.decode_tokens=8 --set 'openloop.rates=[3,5,8,11,15]'
    sweep d8-s1-low --phases 1 --set openloop.decode_tokens=8 --set 'openloop.rates=[3]'
    ;;
  3)
    say "decode bench, fused kernels too"
    (cd "$D/bench/ttft" && PYTHONUNBUFFERED=1 PYTHONPATH=$D/clients/python:$D/bench/ttft \
      python3 -m harness.decode_bench --out "$R/decode-fused" --fused --batches 1,4,16) 2>&1 | tee -a "$LOG"
    pack
    sweep d128-s1 --phases 1 --set openloop.decode_tokens=128 --set 'openloop.rates=[1.5,2.5]'
    sweep d32-s1-low --phases 1 --set openloop.decode_tokens=32 --set 'openloop.rates=[2]'
    ;;
  3q)  # what the budget left after part 2, on the same H200: decode 128, two rates
    sweep d128-s1 --phases 1 --set openloop.decode_tokens=128 --set 'openloop.rates=[1.5,2.5]'
    ;;
esac
say "done"; pack
