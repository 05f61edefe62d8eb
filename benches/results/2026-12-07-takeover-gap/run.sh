#!/bin/bash
# Runs the takeover-gap benchmark, new build vs old build, at several sizes.
R=/work/wt-h-takeover/benches/results/2026-12-07-takeover-gap
B=/tmp/kvnode-new-takeover
for n in 100000 500000 1000000 2000000; do
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  for who in new old; do
    d=/tmp/kvnode-new-takeover; [ $who = old ] && d=/tmp/kvnode-old-takeover
    echo "== $who $n blocks, dram $dram, $(date -u +%FT%TZ)"
    echo "\$ kvnode bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $d"
    $B bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $d --dir /tmp/tk/run-$who 2>&1
    grep -h "live image taken\|built the DRAM\|applied the slots\|took over the DRAM\|handed over" /tmp/tk/run-$who/*.log | sed 's/^/  log: /' | cut -c1-330
  done
done
