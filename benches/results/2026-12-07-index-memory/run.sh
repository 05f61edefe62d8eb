#!/bin/sh
# Old (main f2477f1) against new (h-index42) in one run, this 2-core VM (24 GiB), 4 KiB blocks.
# The bench driver is the new build; --daemon picks the daemon measured.
# /tmp/kvnode-old-index42: `cargo build --release -p kvnode` at f2477f1 (copied from main's target)
# /tmp/kvnode-new-index42: `cargo build --release -p kvnode` at h-index42
set -e
OUT=$(dirname "$0")
for n in 10000:256MiB 1000000:4352MiB 2000000:8448MiB; do
  blocks=${n%%:*}; dram=${n##*:}
  for which in old new; do
    echo "=== $which blocks=$blocks dram=$dram $(date -u +%FT%TZ)"
    /tmp/kvnode-new-index42 bench restart --mode takeover --blocks "$blocks" --block-bytes 4KiB \
      --dram "$dram" --no-populate --probes 20000 --daemon /tmp/kvnode-$which-index42 \
      --dir /var/tmp/kvnode-index42-bench
  done
done
