#!/usr/bin/env bash
# GPU smoke test + benchmark on a CUDA machine. Needs target/release/kvnode (built elsewhere is
# fine), python3 with torch and msgpack. Output goes to stdout and, if set, $OUT/gpu-smoke.log.
# Usage: scripts/gpu-smoke.sh [DRAM]   (env: SIZES, BATCHES, KVNODE_BIN)
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
PID=
start() {
  rm -f "$SOCK"
  "$BIN" serve --socket "$SOCK" --dram "$1" 2>> "$DIR/daemon.log" &
  PID=$!
  for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
}
stop() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; }
trap 'stop; cp "$DIR/daemon.log" "${OUT:-$DIR}/daemon.log" 2>/dev/null' EXIT
echo "== daemon ($DRAM arena)"
start "$DRAM"
echo "== smoke (torch exports a KV tensor; offload, zero, onload, compare every byte)"
PYTHONUNBUFFERED=1 python3 scripts/gpu_smoke.py "$SOCK"; SMOKE=$?
echo "smoke exit: $SMOKE"
echo "== stats after smoke"; "$BIN" stats --socket "$SOCK"
stop
# One daemon per page size: the DRAM tier does not move free slabs between slot classes, so a
# second size in the same daemon would get too few slots for its working set.
BENCH=0
for size in ${SIZES:-1MiB 2MiB 4MiB 8MiB 16MiB}; do
  start "$DRAM"
  for batch in ${BATCHES:-64MiB 256MiB}; do
    echo "== bench $size pages, $batch per request"
    "$BIN" bench gpu --socket "$SOCK" --sizes "$size" --batch-bytes "$batch" --json || BENCH=1
  done
  stop
done
echo "bench exit: $BENCH"
echo "== daemon log (GPU lines)"; grep -iE "cuda|regist|error|warn" "$DIR/daemon.log" | head -20
[ $SMOKE -eq 0 ] && [ $BENCH -eq 0 ]
