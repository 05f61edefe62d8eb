#!/bin/bash
# Issue 42 item 4 on the 2-core VM: does the SIGTERM + start service gap grow with the block
# count when the DRAM tier's size is fixed? 5,376 MiB of DRAM (the 1 M-block run's) holding
# 10 k, 250 k and 1 M blocks of 4 KiB, two clients issuing requests across the stop and the
# start, two passes. NEW is a stripped release build of `-p kvnode`. Output on stdout.
set -u
NEW=${NEW:-/var/tmp/kvnode-new}
DRAM=${DRAM:-5376MiB}
for pass in 1 2; do
  for n in 10000 250000 1000000; do
    echo "== pass $pass: sigterm $n blocks, dram $DRAM, $(date -u +%FT%TZ)"
    "$NEW" bench restart --mode sigterm --blocks $n --block-bytes 4KiB --dram $DRAM --load-clients 2 --daemon "$NEW" --dir /var/tmp/kbr-vm 2>&1
    grep -h "draining in-flight\|copied DRAM blocks\|stop-time flush\|engine released\|kvnode stopped" /var/tmp/kbr-vm/old.log | sed 's/^/  old log: /' | cut -c1-300
    grep -h "kvnode ready\|spill tier recovered" /var/tmp/kbr-vm/new.log | sed 's/^/  new log: /' | cut -c1-300
  done
done
rm -rf /var/tmp/kbr-vm
