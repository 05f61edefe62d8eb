#!/usr/bin/env bash
# Tracing overhead: daemon throughput with `kvtrace latency` attached vs not, in one run
# (ROUNDS alternating off/on runs per workload, medians compared). Needs root (kvtrace).
# Usage: [ROUNDS=5] scripts/bench-trace-overhead.sh [SECONDS_PER_RUN]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
[ -n "${NO_BUILD:-}" ] || cargo build --release -q -p kvnode -p kvtrace
dir=$(mktemp -d)
sock=$dir/kvnode.sock
target/release/kvnode serve --socket "$sock" --dram 1GiB --no-pin 2>"$dir/daemon.log" &
dpid=$!
tpid=
trap 'kill $dpid ${tpid:-} 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
rate() { # prints requests/s of one bench run
  target/release/kvnode bench local --socket "$sock" --duration "$secs" --memcpy-pool 64MiB --json "$@" \
    | tail -1 | sed -E 's/.*"requests_per_s":([0-9.]+).*/\1/'
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
workload() { # alternates off/on runs ${ROUNDS:-5} times; reports the medians
  local name=$1; shift
  local offs=() ons=()
  for _ in $(seq "${ROUNDS:-5}"); do
    offs+=("$(rate "$@")")
    target/release/kvtrace latency --pid "$dpid" --interval 1 >"$dir/kvtrace.out" 2>&1 &
    tpid=$!
    for _ in $(seq 100); do grep -q "attached" "$dir/kvtrace.out" && break; sleep 0.05; done
    grep -q "attached" "$dir/kvtrace.out" || { echo "kvtrace did not attach:"; cat "$dir/kvtrace.out"; exit 1; }
    ons+=("$(rate "$@")")
    kill -INT $tpid; wait $tpid || true; tpid=
  done
  local off on
  off=$(printf '%s\n' "${offs[@]}" | median)
  on=$(printf '%s\n' "${ons[@]}" | median)
  awk -v n="$name" -v a="$off" -v b="$on" -v r="${ROUNDS:-5}" 'BEGIN {
    printf "%-34s median of %d: off %9.0f req/s  on %9.0f req/s  on/off %.3f\n", n, r, a, b, b / a }'
}
workload "get zero-copy 1MiB x16 (default)" --op get
workload "get inline 4KiB x1 (probe-heavy)" --op get --mode inline --page-size 4KiB --batch 1
workload "exists 4KiB x1 (probe-heavy)" --op exists --page-size 4KiB --batch 1
