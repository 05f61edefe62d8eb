#!/usr/bin/env bash
# Runs every benchmark briefly against real daemons: proves they work, not how fast.
#   bench local   put, get (zero-copy and inline), exists
#   bench events  KV events to a live subscriber
#   bench spill   demotion/promotion next to fio (needs fio; on /var/tmp, a real disk)
#   bench backpressure  puts offered faster than the disk, next to fio (needs fio)
#   bench restart every mode: takeover, sigkill, sigterm (small tiers, on /var/tmp)
#   bench pull    two daemons on loopback next to iperf3 (needs iperf3), over TCP and over
#                 UCX (UCX_TLS=tcp; the bench fails when the pull did not use UCX GETs)
#   report        percentile tables and SVG from the live daemon
# Not run: bench gpu (needs a CUDA GPU; scripts/gpu-smoke.sh runs it on GPU machines).
# A missing fio or iperf3 fails the run unless KVNODE_TEST_ALLOW_SKIP lists it (or `all`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvnode
dir=$(mktemp -d /tmp/kvnode-bench-smoke.XXXXXX)
spill=$(mktemp -d /var/tmp/kvnode-bench-smoke-spill.XXXXXX)
sock=$dir/kvnode.sock
$bin serve --socket "$sock" --dram 256MiB --no-pin 2>"$dir/daemon.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir" "$spill"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
need() { # need TOOL: true if installed; else fail, or skip loudly when allowed
  command -v "$1" >/dev/null && return 0
  case ",${KVNODE_TEST_ALLOW_SKIP:-}," in
    *",$1,"*|*",all,"*) echo "!!!!! SKIPPING a benchmark: $1 is not installed (KVNODE_TEST_ALLOW_SKIP)" >&2; return 1 ;;
  esac
  echo "bench-smoke: $1 is not installed (scripts/install-deps.sh); set KVNODE_TEST_ALLOW_SKIP=$1 to skip on purpose" >&2
  exit 1
}
for args in "--op put --page-size 64KiB" "--op get --mode zero-copy --page-size 1MiB --working-set 64" \
            "--op get --mode inline --page-size 1MiB --working-set 64" "--op exists --page-size 4KiB --batch 128"; do
  echo "== bench local $args"
  # shellcheck disable=SC2086
  $bin bench local --socket "$sock" $args --duration 0.5 --memcpy-pool 64MiB
done
echo "== report"
$bin report --socket "$sock" --svg "$dir/report.svg" >/dev/null
test -s "$dir/report.svg"
echo "== bench events"
$bin bench events --duration 0.2
if need fio; then
  echo "== bench spill"
  $bin bench spill --dir "$spill" --size 64MiB --dram 32MiB --bs 1MiB --qd 4
  echo "== bench backpressure"
  $bin bench backpressure --dir "$spill/backpressure" --size 64MiB --dram 32MiB --bs 256KiB --batch 16 --qd 4 --load 2
fi
# sigkill keeps only what was on NVMe: its DRAM tier is a quarter of the blocks put.
for run in "takeover 2000 64MiB" "sigterm 2000 64MiB" "sigkill 4000 16MiB"; do
  read -r mode blocks dram <<<"$run"
  echo "== bench restart --mode $mode"
  $bin bench restart --dir "$spill/restart-$mode" --mode "$mode" --blocks "$blocks" --block-bytes 16KiB --dram "$dram"
done
if need iperf3; then
  echo "== bench pull"
  $bin bench pull --pages 8 --iterations 2 --rounds 1 --latency-samples 20 --iperf-seconds 1
  echo "== bench pull --transport ucx"
  UCX_TLS=tcp $bin bench pull --transport ucx --ucx-software-rma --pages 8 --iterations 2 --rounds 1 --latency-samples 20 --iperf-seconds 1
fi
echo "bench-smoke: every benchmark above ran (bench gpu needs a GPU: scripts/gpu-smoke.sh)"
