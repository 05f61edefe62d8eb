#!/usr/bin/env bash
# CPU cost per GB of peer pulls (both daemons) next to iperf3's (client + server), a figure
# that other processes' load moves much less than throughput. Needs perf, iperf3, python3.
# Usage: scripts/bench-pull-cpu.sh [BIN] [CONNECTIONS] [SERVE_FLAG...]   (default target/release/kvnode, 2;
#        each SERVE_FLAG goes to both daemons, e.g. --cluster-key=/etc/kvnode/key --peer-encrypt)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib-pull.sh
pull_args "$@"
tmp=$(mktemp -d /tmp/kvnode-pull-cpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# 600 pulls of 64 x 1 MiB; measure a 6 s window in the middle of them.
pull_start "$tmp"
i0=$(pull_inserts)
perf stat -x, -e task-clock -p "$src,$dst" -o "$tmp/pull.perf" -- sleep 6
i1=$(pull_inserts)
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
