#!/usr/bin/env bash
# Side-by-side A/B of two kvnode builds on the same machine in one run, ordered A B B A so
# that drift hits both equally: zero-copy `get` (bench local, vs same-run memcpy) and peer
# pulls (bench pull, vs same-run iperf3). Each line is one run; compare the ratios.
# Usage: scripts/bench-abba.sh OLD_BIN NEW_BIN [ROUNDS]   (ROUNDS of ABBA, default 1)
set -euo pipefail
A=${1:?old kvnode binary}; B=${2:?new kvnode binary}; ROUNDS=${3:-1}
DIR=$(mktemp -d /tmp/kvnode-abba.XXXXXX)
trap 'pkill -f "$DIR/" 2>/dev/null || true; rm -rf "$DIR"' EXIT
local_run() { # BIN LABEL
  local sock="$DIR/$2.sock"
  "$1" serve --socket "$sock" --dram 2GiB --no-pin 2>>"$DIR/$2.log" &
  local pid=$!
  until "$1" stats --socket "$sock" >/dev/null 2>&1; do sleep 0.02; done
  local j
  j=$("$1" bench local --socket "$sock" --op get --mode zero-copy --page-size 1MiB --batch 16 \
        --duration 3 --working-set 512 --memcpy-pool 1GiB --json | tail -1)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 -c 'import json,sys; j=json.loads(sys.argv[2]); print(f"{sys.argv[1]:4} local zero-copy get: {j[\"gbps\"]:.2f} GB/s = {j[\"ratio\"]:.2f} x memcpy ({j[\"memcpy_gbps\"]:.2f} GB/s), p50 {j[\"p50_us\"]} us")' "$2" "$j"
}
pull_run() { # BIN LABEL
  local j
  j=$("$1" bench pull --iterations 10 --rounds 2 --latency-samples 100 --iperf-seconds 2 --json 2>>"$DIR/$2.log" | tail -1)
  python3 -c 'import json,sys; j=json.loads(sys.argv[2]); r=j["ratio"]; print(f"{sys.argv[1]:4} pull 64x1MiB: median {j[\"median_gbps\"]:.2f} GB/s = {r*100 if r else float(\"nan\"):.0f} % of iperf3, 64 KiB p50 {j[\"lat_p50_us\"]} us p99 {j[\"lat_p99_us\"]} us")' "$2" "$j"
}
echo "A = $A"; echo "B = $B"; echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq "$ROUNDS"); do
  for x in A B B A; do
    bin=$A; [ "$x" = B ] && bin=$B
    local_run "$bin" "$x"
  done
  for x in A B B A; do
    bin=$A; [ "$x" = B ] && bin=$B
    pull_run "$bin" "$x"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
