#!/usr/bin/env bash
# Tracing overhead: daemon throughput with `kvtrace latency` attached vs not, in one run.
#
# Default (alternating): one daemon; per workload ROUNDS pairs of `kvnode bench local` runs,
# untraced and traced, the order alternating between pairs (off,on / on,off).
# PARALLEL=1: two identical daemons driven at the same time, one traced, the traced one
# swapping every round; load from other processes then hits both sides of a pair equally.
# Reports the median, interquartile range and range of the per-pair on/off throughput ratios,
# the median rates, and the daemon's CPU time per request (utime + stime, 10 ms ticks).
# Needs root (kvtrace).
# Usage: [ROUNDS=8] [PARALLEL=1] [CONCURRENCY=1] [KVTRACE_ARGS=...] [NO_BUILD=1]
#        scripts/bench-trace-overhead.sh [SECONDS_PER_RUN]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-3}
rounds=${ROUNDS:-8}
conc=${CONCURRENCY:-1}
[ -n "${NO_BUILD:-}" ] || cargo build --release -q -p kvnode -p kvtrace
dir=$(mktemp -d)
pids=()
tpid=
trap 'kill ${pids[*]} ${tpid:-} 2>/dev/null || true; rm -rf "$dir"' EXIT
for d in a b; do
  target/release/kvnode serve --socket "$dir/$d.sock" --dram 1GiB --no-pin 2>"$dir/$d.log" &
  pids+=($!)
  [ -n "${PARALLEL:-}" ] || break
done
for _ in $(seq 100); do [ -S "$dir/a.sock" ] && { [ -z "${PARALLEL:-}" ] || [ -S "$dir/b.sock" ]; } && break; sleep 0.05; done
cpu_ns() { # CPU time of daemon $1 so far, exited threads included (utime + stime, in ticks)
  awk -v hz="$(getconf CLK_TCK)" '{ sub(/.*\) /, ""); printf "%.0f\n", ($12 + $13) * 1e9 / hz }' /proc/"$1"/stat
}
run() { # run DAEMON_INDEX ARGS...: prints "requests/s daemon-cpu-us-per-request"
  local i=$1; shift
  local sock=$dir/$([ "$i" = 0 ] && echo a || echo b).sock pid=${pids[$i]} c0 c1 out
  c0=$(cpu_ns "$pid")
  out=$(target/release/kvnode bench local --socket "$sock" --duration "$secs" \
    --concurrency "$conc" --memcpy-pool 64MiB --json "$@" | tail -1)
  c1=$(cpu_ns "$pid")
  echo "$out" | sed -E 's/.*"requests_per_s":([0-9.]+).*"secs":([0-9.]+).*/\1 \2/' |
    awk -v c=$((c1 - c0)) '{ printf "%.1f %.2f\n", $1, c / 1e3 / ($1 * $2) }'
}
attach() { # attach kvtrace latency to daemon index $1
  target/release/kvtrace latency --pid "${pids[$1]}" --interval 1 ${KVTRACE_ARGS:-} >"$dir/kvtrace.out" 2>&1 &
  tpid=$!
  for _ in $(seq 200); do grep -q "attached" "$dir/kvtrace.out" && break; sleep 0.05; done
  grep -q "attached" "$dir/kvtrace.out" || { echo "kvtrace did not attach:"; cat "$dir/kvtrace.out"; exit 1; }
}
detach() { kill -INT $tpid; wait $tpid || true; tpid=; }
pair() { # round $1: prints "off-rate off-cpu on-rate on-cpu"
  local r=$1; shift
  local off on t
  if [ -n "${PARALLEL:-}" ]; then
    t=$((r % 2))
    attach $t
    run $((1 - t)) "$@" >"$dir/off" & local p1=$!
    run $t "$@" >"$dir/on" & local p2=$!
    wait $p1 $p2
    detach
    off=$(cat "$dir/off"); on=$(cat "$dir/on")
  elif [ $((r % 2)) -eq 1 ]; then
    off=$(run 0 "$@"); attach 0; on=$(run 0 "$@"); detach
  else
    attach 0; on=$(run 0 "$@"); detach; off=$(run 0 "$@")
  fi
  echo "$off $on"
}
workload() {
  local name=$1; shift
  local pairs=()
  for r in $(seq "$rounds"); do pairs+=("$(pair "$r" "$@")"); done
  [ -z "${VERBOSE:-}" ] || printf '  %s\n' "${pairs[@]}" >&2
  printf '%s\n' "${pairs[@]}" | awk -v n="$name" -v r="$rounds" -v c="$conc" -v m="${PARALLEL:+parallel}" '
    function med(a, k,   i, j, t) { for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2 }
    { off[NR] = $1; offc[NR] = $2; on[NR] = $3; onc[NR] = $4; q[NR] = $3 / $1 }
    END {
      lo = hi = q[1]; for (i = 2; i <= NR; i++) { if (q[i] < lo) lo = q[i]; if (q[i] > hi) hi = q[i] }
      mq = med(q, NR) # sorts q
      printf "%-34s %s c=%d pairs=%d  off %8.0f req/s  on %8.0f req/s  on/off %.3f (IQR %.3f-%.3f, range %.3f-%.3f)  daemon cpu/req %.1f -> %.1f us\n",
        n, m ? m : "alternating", c, r, med(off, NR), med(on, NR), mq, q[int((NR + 3) / 4)], q[int((3 * NR + 3) / 4)], lo, hi, med(offc, NR), med(onc, NR) }'
}
workload "get zero-copy 1MiB x16 (default)" --op get
workload "get inline 4KiB x1 (probe-heavy)" --op get --mode inline --page-size 4KiB --batch 1
workload "exists 4KiB x1 (probe-heavy)" --op exists --page-size 4KiB --batch 1
