#!/bin/sh
# Issue 42: the takeover's service gap with KV events on (--events), new build (live build
# under a pending announcer) against old (the whole image at the barrier when events are on).
# NEW/OLD: daemon binaries (stripped release builds of `-p kvnode`); the bench is NEW's.
# Usage: NEW=/tmp/kvnode-ev42 OLD=/tmp/kvnode-abba-new sh run.sh > raw.txt 2>&1
set -u
for n in ${SIZES:-500000 1000000 2000000}; do
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  for who in new old; do
    d=$NEW; [ "$who" = old ] && d=$OLD
    echo "== $who $n blocks, events on, dram $dram, $(date -u +%FT%TZ)"
    echo "\$ kvnode bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --events --daemon $who"
    timeout 600 "$NEW" bench restart --mode takeover --blocks "$n" --block-bytes 4KiB --dram "$dram" \
      --load-clients 2 --events --daemon "$d" --dir /var/tmp/kvnode-tk-ev 2>&1
    echo "rc=$?"
    grep -h "live image taken\|built the DRAM\|pre-copy round\|applied the slots\|took over the DRAM\|handed over\|continue the previous" \
      /var/tmp/kvnode-tk-ev/*.log | sed 's/^/  log: /' | cut -c1-300
  done
done
rm -rf /var/tmp/kvnode-tk-ev
