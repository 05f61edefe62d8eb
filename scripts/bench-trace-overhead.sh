#!/usr/bin/env bash
# Tracing overhead: daemon throughput with `kvtrace latency` attached vs not, in one run.
# Per workload, ROUNDS pairs of `kvnode bench local` runs against one daemon, alternating the
# order inside each pair (off,on then on,off: drift from other load cancels); reports the
# median and range of the per-pair on/off ratios, the median rates, and the daemon's CPU time
# per request (sum over its threads' schedstat). Needs root (kvtrace).
# Usage: [ROUNDS=6] [CONCURRENCY=1] [KVTRACE_ARGS=...] [NO_BUILD=1]
#        scripts/bench-trace-overhead.sh [SECONDS_PER_RUN]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-3}
rounds=${ROUNDS:-6}
conc=${CONCURRENCY:-1}
[ -n "${NO_BUILD:-}" ] || cargo build --release -q -p kvnode -p kvtrace
dir=$(mktemp -d)
sock=$dir/kvnode.sock
target/release/kvnode serve --socket "$sock" --dram 1GiB --no-pin 2>"$dir/daemon.log" &
dpid=$!
tpid=
trap 'kill $dpid ${tpid:-} 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
cpu_ns() { # CPU time of every daemon thread so far
  cat /proc/$dpid/task/*/schedstat | awk '{ s += $1 } END { printf "%.0f\n", s }'
}
run() { # prints "requests/s daemon-cpu-us-per-request" of one bench run
  local c0 c1 out
  c0=$(cpu_ns)
  out=$(target/release/kvnode bench local --socket "$sock" --duration "$secs" \
    --concurrency "$conc" --memcpy-pool 64MiB --json "$@" | tail -1)
  c1=$(cpu_ns)
  echo "$out" | sed -E 's/.*"requests_per_s":([0-9.]+).*"secs":([0-9.]+).*/\1 \2/' |
    awk -v c=$((c1 - c0)) '{ printf "%.1f %.2f\n", $1, c / 1e3 / ($1 * $2) }'
}
traced() { # one run with kvtrace latency attached
  target/release/kvtrace latency --pid "$dpid" --interval 1 ${KVTRACE_ARGS:-} >"$dir/kvtrace.out" 2>&1 &
  tpid=$!
  for _ in $(seq 200); do grep -q "attached" "$dir/kvtrace.out" && break; sleep 0.05; done
  grep -q "attached" "$dir/kvtrace.out" || { echo "kvtrace did not attach:"; cat "$dir/kvtrace.out"; exit 1; }
  run "$@"
  kill -INT $tpid; wait $tpid || true; tpid=
}
med() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
workload() {
  local name=$1; shift
  local pairs=() off on r
  for i in $(seq "$rounds"); do
    if [ $((i % 2)) -eq 1 ]; then off=$(run "$@"); on=$(traced "$@"); else on=$(traced "$@"); off=$(run "$@"); fi
    pairs+=("$off $on")
  done
  printf '%s\n' "${pairs[@]}" | awk -v n="$name" -v r="$rounds" -v c="$conc" '
    function med(a, k,   i, j, t) { for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2 }
    { off[NR] = $1; offc[NR] = $2; on[NR] = $3; onc[NR] = $4; q[NR] = $3 / $1 }
    END {
      lo = hi = q[1]; for (i = 2; i <= NR; i++) { if (q[i] < lo) lo = q[i]; if (q[i] > hi) hi = q[i] }
      printf "%-34s c=%d pairs=%d  off %8.0f req/s  on %8.0f req/s  on/off %.3f (%.3f-%.3f)  daemon cpu/req %.1f -> %.1f us\n",
        n, c, r, med(off, NR), med(on, NR), med(q, NR), lo, hi, med(offc, NR), med(onc, NR) }'
}
workload "get zero-copy 1MiB x16 (default)" --op get
workload "get inline 4KiB x1 (probe-heavy)" --op get --mode inline --page-size 4KiB --batch 1
workload "exists 4KiB x1 (probe-heavy)" --op exists --page-size 4KiB --batch 1
