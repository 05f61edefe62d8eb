#!/usr/bin/env bash
# GPU smoke test + benchmark on a CUDA machine. Needs target/release/kvnode (built elsewhere is
# fine), python3 with torch and msgpack. Output goes to stdout and, if set, $OUT/gpu-smoke.log.
# Usage: scripts/gpu-smoke.sh [DRAM]
set -u -o pipefail
cd "$(dirname "$0")/.."
BIN=${KVNODE_BIN:-target/release/kvnode}
DRAM=${1:-8GiB}
DIR=$(mktemp -d /tmp/kvnode-gpu.XXXXXX)
SOCK=$DIR/kvnode.sock
LOG=${OUT:-$DIR}/gpu-smoke.log
exec > >(tee "$LOG") 2>&1
echo "== host"; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
echo "== daemon ($DRAM arena)"
"$BIN" serve --socket "$SOCK" --dram "$DRAM" 2> "$DIR/daemon.log" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; cp "$DIR/daemon.log" "${OUT:-$DIR}/daemon.log" 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
echo "== smoke (torch exports a KV tensor; offload, zero, onload, compare every byte)"
PYTHONUNBUFFERED=1 python3 scripts/gpu_smoke.py "$SOCK"; SMOKE=$?
echo "smoke exit: $SMOKE"
echo "== bench"
"$BIN" bench gpu --socket "$SOCK" --json ${BENCH_ARGS:-}; BENCH=$?
echo "bench exit: $BENCH"
echo "== stats"; "$BIN" stats --socket "$SOCK"
echo "== daemon log (GPU lines)"; grep -iE "gpu|cuda|regist|error|warn" "$DIR/daemon.log" | head -40
[ $SMOKE -eq 0 ] && [ $BENCH -eq 0 ]
