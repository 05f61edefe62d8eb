#!/usr/bin/env bash
# Runs each benchmark briefly against a real daemon: proves they work, not how fast.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvnode
dir=$(mktemp -d /tmp/kvnode-bench-smoke.XXXXXX)
sock=$dir/kvnode.sock
$bin serve --socket "$sock" --dram 256MiB --no-pin 2>"$dir/daemon.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
for args in "--op put --page-size 64KiB" "--op get --mode zero-copy --page-size 1MiB --working-set 64" \
            "--op get --mode inline --page-size 1MiB --working-set 64" "--op exists --page-size 4KiB --batch 128"; do
  # shellcheck disable=SC2086
  $bin bench local --socket "$sock" $args --duration 0.5 --memcpy-pool 64MiB
done
$bin bench events --duration 0.2
