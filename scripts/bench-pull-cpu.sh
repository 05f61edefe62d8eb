#!/usr/bin/env bash
# CPU cost per GB of peer pulls (both daemons) next to iperf3's (client + server), a figure
# that other processes' load moves much less than throughput. Needs perf, iperf3, python3.
# Usage: scripts/bench-pull-cpu.sh [BIN] [CONNECTIONS] [SERVE_FLAG...]   (default target/release/kvnode, 2;
#        each SERVE_FLAG goes to both daemons, e.g. --cluster-key=/etc/kvnode/key --peer-encrypt)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/release/kvnode}")
conns=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
dargs=()
for f in "$@"; do dargs+=("--daemon-arg=$f"); done
tmp=$(mktemp -d /tmp/kvnode-pull-cpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
inserts() { "$bin" stats --socket "$1" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["stats"]["tiers"][0]["inserts"])'; }

# 600 pulls of 64 x 1 MiB; measure a 6 s window in the middle of them.
"$bin" bench pull --rounds 1 --iterations 600 --latency-samples 1 --iperf-seconds 0 --connections "$conns" ${dargs[@]+"${dargs[@]}"} >"$tmp/bench.txt" 2>&1 &
bench=$!
sleep 4
src=$(pgrep -P "$bench" -f 'serve.*--peer-listen')
dst=$(pgrep -P "$bench" -f 'serve.*--peers')
sock=$(tr '\0' '\n' <"/proc/$dst/cmdline" | grep -A1 -x -- --socket | tail -1)
i0=$(inserts "$sock")
perf stat -x, -e task-clock -p "$src,$dst" -o "$tmp/pull.perf" -- sleep 6
i1=$(inserts "$sock")
wait "$bench"
ms=$(grep task-clock "$tmp/pull.perf" | cut -d, -f1)
python3 -c "gb=($i1-$i0)*1048576/1e9; print(f'pull ({$conns} connections): {gb/6:.2f} GB/s, daemons {$ms/1e3:.2f} CPU-s = {$ms/1e3/gb:.3f} CPU-s/GB')"

port=$((20000 + RANDOM % 20000))
perf stat -x, -e task-clock -o "$tmp/srv.perf" iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
srv=$!
sleep 0.5
perf stat -x, -e task-clock -o "$tmp/cli.perf" iperf3 -c 127.0.0.1 -p "$port" -l 1M -n 8G >/dev/null
wait "$srv"
a=$(grep task-clock "$tmp/srv.perf" | cut -d, -f1)
b=$(grep task-clock "$tmp/cli.perf" | cut -d, -f1)
python3 -c "gb=8*1.073741824; print(f'iperf3 -l 1M: {($a+$b)/1e3:.2f} CPU-s = {($a+$b)/1e3/gb:.3f} CPU-s/GB')"
