#!/usr/bin/env bash
# Time-to-first-token benchmark: kvnode tiers against recompute on a real GPU (bench/ttft).
# Needs: a kvnode binary (KVNODE_BIN, default target/release/kvnode), python3 with torch (CUDA)
# and msgpack. Writes results.json, summary.json, report.md, ttft.svg and daemon logs to
# $OUT (or ./ttft-out).
# Usage: scripts/bench-ttft.sh [h200|tiny] [extra args for `python -m harness.run`]
#   e.g. scripts/bench-ttft.sh h200 --phases 1 --sections long_prefix
#        scripts/bench-ttft.sh tiny                       (CPU, no CUDA: the CI configuration)
# Env: SPILL_ROOT  directory for the NVMe tier (must support O_DIRECT: not tmpfs)
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PROFILE=${1:-h200}; shift || true
export KVNODE_BIN=${KVNODE_BIN:-$ROOT/target/release/kvnode}
DEST=${OUT:-$PWD/ttft-out}
mkdir -p "$DEST"
echo "== host: $(uname -r); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo no GPU)"
echo "== disk for the NVMe tier: $(df -h "${SPILL_ROOT:-/var/tmp}" | tail -1)"
python3 -c 'import torch, msgpack; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
SPILL=()
[ -n "${SPILL_ROOT:-}" ] && SPILL=(--spill-root "$SPILL_ROOT")
cd "$ROOT/bench/ttft"
PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/clients/python:$ROOT/bench/ttft" \
  python3 -m harness.run --profile "$PROFILE" --out "$DEST" "${SPILL[@]}" "$@" 2>&1 | tee "$DEST/bench-ttft.log"
exit "${PIPESTATUS[0]}"
