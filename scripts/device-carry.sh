#!/usr/bin/env bash
# Prepares bin/ for a lent GPU machine (the `device` tool copies the working tree, untracked
# files included): the daemon, iproute2 (ip, tc: the peer arm's network namespace and tc
# shaping) with its libraries, and the UCX libraries the daemon links. The device's image
# may lack iproute2 and UCX; the wrappers in bin/path set LD_LIBRARY_PATH for ip and tc only.
#   KVNODE=path/to/kvnode scripts/device-carry.sh   # or build: cargo build --release -p kvnode
# Then, on the device (from the repo root):
#   export PATH=$PWD/bin/path:$PATH; gunzip -f bin/kvnode.gz; chmod +x bin/kvnode
#   ldd bin/kvnode | grep -q "not found" && export LD_LIBRARY_PATH=$PWD/bin/lib
#   RUNS="1 2" bash bench/ttft/device-issue41.sh
# Remove bin/ afterwards (it is untracked: `rm -rf bin`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVNODE:-}
if [ -z "$bin" ]; then
  cargo build --release -p kvnode
  bin=target/release/kvnode
fi
if "$bin" serve --print-config > /dev/null 2>&1; then :; else
  echo "device-carry: $bin does not serve (a test-seams build?); build with cargo build --release -p kvnode" >&2
  exit 1
fi
rm -rf bin
mkdir -p bin/iproute bin/path bin/lib
strip -o bin/kvnode "$bin"
gzip -f bin/kvnode
for t in ip tc; do
  cp "$(command -v "$t" || echo "/usr/sbin/$t")" bin/iproute/
  printf '#!/bin/sh\nD=$(cd "$(dirname "$0")/../iproute" && pwd)\nLD_LIBRARY_PATH="$D${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$D/%s" "$@"\n' "$t" > "bin/path/$t"
  chmod +x "bin/path/$t"
done
# Every library ip and tc load, but the C runtime's own.
for l in $(ldd bin/iproute/ip bin/iproute/tc | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$l")" in libc.so*|libm.so*|ld-linux*) ;; *) cp -L "$l" bin/iproute/ ;; esac
done
for l in $(ldd "$bin" | awk '/libuc[pstm]|libnuma/ {print $3}'); do cp -L "$l" bin/lib/; done
du -sh bin
