#!/bin/bash
# Issue 42 item 4 on the 2-core VM: SIGTERM + start on the same spill directory with two
# clients issuing requests across it, and a takeover over a spill tier holding 750k blocks;
# new build against old (A B B A). NEW and OLD are stripped release builds of `-p kvnode`
# (old: 4798c87). Output on stdout.
set -u
NEW=${NEW:-/var/tmp/kvnode-new}; OLD=${OLD:-/var/tmp/kvnode-oldbin}
for n in 250000 1000000; do
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  for who in new old old new; do
    d=$NEW; [ $who = old ] && d=$OLD
    echo "== $who sigterm $n blocks, dram $dram, $(date -u +%FT%TZ)"
    "$NEW" bench restart --mode sigterm --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon "$d" --dir /var/tmp/kbr-vm 2>&1
    grep -h "draining in-flight\|copied DRAM blocks\|stop-time flush\|engine released\|kvnode stopped" /var/tmp/kbr-vm/old.log | sed 's/^/  old log: /' | cut -c1-300
    grep -h "kvnode ready\|spill tier recovered" /var/tmp/kbr-vm/new.log | sed 's/^/  new log: /' | cut -c1-300
  done
done
for who in new old old new; do
  d=$NEW; [ $who = old ] && d=$OLD
  echo "== $who takeover --spill 1000000 blocks, dram 1GiB, $(date -u +%FT%TZ)"
  "$NEW" bench restart --mode takeover --spill --blocks 1000000 --block-bytes 4KiB --dram 1GiB --load-clients 2 --daemon "$d" --dir /var/tmp/kbr-vm 2>&1
  grep -h "took over the DRAM\|kvnode ready\|spill tier recovered" /var/tmp/kbr-vm/new.log | sed 's/^/  new log: /' | cut -c1-300
done
rm -rf /var/tmp/kbr-vm
