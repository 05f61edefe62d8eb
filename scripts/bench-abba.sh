#!/usr/bin/env bash
# Side-by-side A/B of two kvnode builds on the same machine in one run, ordered A B B A so
# that drift hits both equally: zero-copy `get` (bench local, vs same-run memcpy) and peer
# pulls (bench pull, vs same-run iperf3). Each line is one run; compare the ratios.
# Usage: scripts/bench-abba.sh OLD_BIN NEW_BIN [ROUNDS]   (ROUNDS of ABBA, default 1)
# PULL_ARGS adds `bench pull` flags to every pull run, e.g.
#   PULL_ARGS="--connections 1 --daemon-arg=--cluster-key=/tmp/key" scripts/bench-abba.sh A B
# SKIP_LOCAL=1 / SKIP_PULL=1 leave out the local / pull rounds. STORE=1 adds the NVMe tier's rounds (issue 27: the
# moves between tiers must not get slower): `bench spill` (demotion and promotion vs same-run
# fio, each build driving its own daemon) and `bench restart --mode sigkill` (first hit after a
# SIGKILL with a spilled tier; NEW's driver restarts each build's daemon, so both are timed
# alike). SPILL_ARGS / RESTART_ARGS replace their defaults.
set -euo pipefail
A=${1:?old kvnode binary}; B=${2:?new kvnode binary}; ROUNDS=${3:-1}
DIR=$(mktemp -d /tmp/kvnode-abba.XXXXXX)
PIDS=()
trap 'for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"' EXIT
local_run() { # BIN LABEL
  local sock="$DIR/$2.sock"
  "$1" serve --socket "$sock" --dram 2GiB --no-pin 2>>"$DIR/$2.log" &
  local pid=$!
  PIDS+=("$pid")
  until "$1" stats --socket "$sock" >/dev/null 2>&1; do sleep 0.02; done
  local j
  j=$("$1" bench local --socket "$sock" --op get --mode zero-copy --page-size 1MiB --batch 16 \
        --duration 3 --working-set 512 --memcpy-pool 1GiB --json | tail -1)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$2" "$j" <<'PY'
import json, sys
j = json.loads(sys.argv[2])
print("%-4s local zero-copy get: %.2f GB/s = %.2f x memcpy (%.2f GB/s), p50 %s us"
      % (sys.argv[1], j["gbps"], j["ratio"], j["memcpy_gbps"], j["p50_us"]))
PY
}
pull_run() { # BIN LABEL
  local j
  # shellcheck disable=SC2086
  j=$("$1" bench pull --iterations 10 --rounds 2 --latency-samples 100 --iperf-seconds 2 ${PULL_ARGS:-} --json 2>>"$DIR/$2.log" | tail -1)
  python3 - "$2" "$j" <<'PY'
import json, sys
j = json.loads(sys.argv[2])
r = j["ratio"]
rp = j.get("ratio_p")
cpu = j.get("cpu_s_per_gb")
cr = j.get("cpu_ratio")
print("%-4s pull 64x1MiB: median %.2f GB/s = %s of iperf3%s, %.0f %% of memcpy; first pull %.2f GB/s; 64 KiB p50 %s us p99 %s us%s"
      % (sys.argv[1], j["median_gbps"], "%.0f %%" % (r * 100) if r else "n/a",
         " (%.0f %% of -P %s)" % (rp * 100, j.get("connections")) if rp else "",
         j["memcpy_ratio"] * 100, j["first_gbps"], j["lat_p50_us"], j["lat_p99_us"],
         "; %.3f CPU-s/GB%s" % (cpu, " = %.2f x iperf3" % cr if cr else "") if cpu is not None else ""))
PY
}
spill_run() { # BIN LABEL
  # shellcheck disable=SC2086
  "$1" bench spill --dir "$DIR/spill-$2" ${SPILL_ARGS:---size 1GiB --dram 256MiB} 2>>"$DIR/$2.log" \
    | awk -v l="$2" '/^demotion|^promotion|^restart after/ { printf "%-4s spill: %s\n", l, $0 }'
  rm -rf "$DIR/spill-$2"
}
restart_run() { # BIN LABEL
  # shellcheck disable=SC2086
  "$B" bench restart --dir "$DIR/restart-$2" --mode sigkill --daemon "$1" \
    ${RESTART_ARGS:---blocks 50000 --block-bytes 16KiB --dram 256MiB} 2>>"$DIR/$2.log" \
    | awk -v l="$2" '/^first hit|^new daemon/ { printf "%-4s restart: %s\n", l, $0 }'
  rm -rf "$DIR/restart-$2"
}
echo "A = $A"; echo "B = $B"; echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq "$ROUNDS"); do
  for x in A B B A; do
    [ -n "${SKIP_LOCAL:-}" ] && break
    bin=$A; [ "$x" = B ] && bin=$B
    local_run "$bin" "$x"
  done
  for x in A B B A; do
    [ -n "${SKIP_PULL:-}" ] && break
    bin=$A; [ "$x" = B ] && bin=$B
    pull_run "$bin" "$x"
  done
  for x in A B B A; do
    [ -n "${STORE:-}" ] || break
    bin=$A; [ "$x" = B ] && bin=$B
    spill_run "$bin" "$x"
    restart_run "$bin" "$x"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
