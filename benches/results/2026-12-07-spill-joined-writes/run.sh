#!/bin/sh
# SIGTERM (stop-time flush of every DRAM block) then a start, 200 000 blocks of 4 KiB, this VM's
# virtio disk; old = /tmp/kvnode-new2 (e40f34e: header and payload two writes), new =
# /tmp/kvnode-join (one write for payloads up to 64 KiB, and the recovery index reserved), ABBA.
for d in /tmp/kvnode-new2 /tmp/kvnode-join /tmp/kvnode-join /tmp/kvnode-new2; do
  echo "== daemon $d $(date -u +%FT%TZ)"
  /tmp/kvnode-join bench restart --mode sigterm --blocks 200000 --block-bytes 4KiB --dram 2GiB --daemon "$d" \
    --dir /var/tmp/kvnode-bench-join 2>&1 | grep -v "^  "
done
