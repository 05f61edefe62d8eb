#!/usr/bin/env bash
# Peer pulls on a many-core host: two daemons on loopback TCP with a cluster key, pull GB/s
# (`kvnode bench pull --connections N`) next to `iperf3 -P N -l 1M` in the same run, for
# N = 1, 2, 4, 8 (iperf3 before and after each pull run, so drift shows). Results: one line per
# N on stdout and the raw outputs in $OUT (default /tmp/peer-cores).
# Needs: a kvnode binary (KVNODE_BIN, default target/release/kvnode), iperf3, python3.
# Usage: scripts/bench-peer-cores.sh [CONNECTION COUNTS...]     (default: 1 2 4 8)
set -u -o pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${KVNODE_BIN:-target/release/kvnode}")
dest=${OUT:-/tmp/peer-cores}
mkdir -p "$dest"
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(1 2 4 8)
key=$(mktemp /tmp/kvnode-peer-key.XXXXXX)
trap 'rm -f "$key"' EXIT
python3 -c 'import os,sys; open(sys.argv[1],"w").write(os.urandom(32).hex()+"\n")' "$key"
chmod 600 "$key"
echo "== host: $(nproc) cores, $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"

iperf() {  # iperf() N -> GB/s of iperf3 -P N over loopback, 3 s
  local port=$((20000 + RANDOM % 20000))
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local srv=$!
  local out=""
  for _ in $(seq 50); do
    out=$(iperf3 -c 127.0.0.1 -p "$port" -P "$1" -l 1M -t 3 -J 2>/dev/null) && break
    sleep 0.1
  done
  wait "$srv" 2>/dev/null
  echo "$out" | python3 -c 'import json,sys; print("%.3f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9))'
}

for n in "${counts[@]}"; do
  before=$(iperf "$n")
  "$bin" bench pull --connections "$n" --rounds 2 --iterations 12 --latency-samples 50 \
    --iperf-seconds 0 --json --daemon-arg="--cluster-key=$key" >"$dest/pull-c$n.txt" 2>&1
  rc=$?
  after=$(iperf "$n")
  pull=$(grep -m1 '^{' "$dest/pull-c$n.txt" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("median %.3f best %.3f" % (d["median_gbps"], d["best_gbps"]))' 2>/dev/null || echo "?")
  echo "N=$n pull GB/s ${pull} (rc $rc); iperf3 -P $n GB/s: ${before} before, ${after} after"
done
