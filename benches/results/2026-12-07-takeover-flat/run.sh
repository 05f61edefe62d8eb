#!/bin/bash
# Issue 42 item 1: the takeover's service gap with 2 load clients, new build (pre-copy
# rounds) against old (/tmp/kvnode-old-gap42: main before them), alternating per size, on
# this 2-core VM. Per run: the bench's report, the eight largest intervals between answers
# (ms after the successor's spawn), the barrier's place (donor stops accepting -> successor
# took over, ms after the spawn, from the daemons' logs), and the takeover log lines.
# Run from the repo root: bash benches/results/2026-12-07-takeover-flat/run.sh > raw.txt
set -u
NEW=${NEW:-/tmp/kvnode-new-gap42}
OLD=${OLD:-/tmp/kvnode-old-gap42}
SIZES=${SIZES:-500000 1000000 2000000 3000000}
barrier() { # spawn-unix-seconds log-dir
  python3 - "$1" "$2" <<'PY'
import sys, re, glob, datetime
spawn = float(sys.argv[1]); d = sys.argv[2]
def at(pat, f):
    for l in open(f, errors="replace"):
        if re.search(pat, l):
            t = datetime.datetime.fromisoformat(l.split()[0].replace("Z", "+00:00"))
            return (t.timestamp() - spawn) * 1e3
stop = at("takeover: draining in-flight requests", d + "/old.log")
took = at("took over the DRAM tier", d + "/new.log")
print(f"  barrier: donor stops accepting at {stop:.0f} ms, successor took over at {took:.0f} ms after the spawn")
PY
}
for n in $SIZES; do
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  for who in new old; do
    d=$NEW; [ $who = old ] && d=$OLD
    dir=/tmp/tk42/run-$who
    echo "== $who $n blocks, dram $dram, $(date -u +%FT%TZ)"
    echo "\$ kvnode bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $d"
    out=$($NEW bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $d --dir $dir 2>&1)
    echo "$out"
    s=$(echo "$out" | sed -n 's/^successor spawned at unix \([0-9.]*\) s/\1/p')
    [ -n "$s" ] && barrier "$s" "$dir"
    grep -h "live image taken\|built the DRAM\|pre-copy\|applied the slots\|took over the DRAM\|handed over" $dir/*.log | sed 's/^/  log: /' | cut -c1-300
    rm -rf $dir
  done
done
