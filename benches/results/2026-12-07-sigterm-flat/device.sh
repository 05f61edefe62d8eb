#!/bin/bash
# Issue 42 item 4 on the lent GPU host (16 cores, 125 GiB RAM, 64 GiB disk): SIGTERM + start
# on the same spill directory (and a takeover over a spill tier holding most blocks) with two
# clients issuing requests across it, new build against old.
# Run from the repo root with bin/kvnode-new.xz and bin/kvnode-old.xz (stripped release builds
# of `-p kvnode`; old: 4798c87):  SPECS="..." bash benches/results/2026-12-07-sigterm-flat/device.sh
# A spec is "who blocks limit_s mode dram [extra flags...]" separated by ';' (dram "auto":
# 1.25 x the blocks + 256 MiB). A run whose limit does not fit the call's remaining time
# (BUDGET_S, default 560) is skipped and says so. Output: $OUT/raw-$TAG.txt.
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
TAG=${TAG:-run}
[ -x /tmp/kn ] || { xz -d -c bin/kvnode-new.xz > /tmp/kn && chmod +x /tmp/kn; }
[ -x /tmp/ko ] || { xz -d -c bin/kvnode-old.xz > /tmp/ko && chmod +x /tmp/ko; }
R=$OUT/raw-$TAG.txt
{ echo "== host $(date -u +%FT%TZ)"; nproc; free -g; df -h /tmp | tail -1; /tmp/kn --version; /tmp/ko --version; } >> "$R" 2>&1
IFS=';' read -r -a LIST <<< "$SPECS"
for spec in "${LIST[@]}"; do
  set -- $spec; who=$1; n=$2; limit=$3; mode=$4; dram=$5; shift 5
  d=/tmp/kn; [ "$who" = old ] && d=/tmp/ko
  left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$limit" ]; then
    echo "== $who $n $mode $* skipped: ${left} s left of the call" >> "$R"
    continue
  fi
  [ "$dram" = auto ] && dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  dir=/tmp/ks/run-$who-$n-$mode
  echo "== $who $n blocks, mode $mode, dram $dram, $(date -u +%FT%TZ)" >> "$R"
  echo "\$ kvnode bench restart --mode $mode --blocks $n --block-bytes 4KiB --dram $dram --daemon $who $*" >> "$R"
  timeout "$limit" /tmp/kn bench restart --mode "$mode" --blocks "$n" --block-bytes 4KiB --dram "$dram" \
    --daemon "$d" --dir "$dir" "$@" >> "$R" 2>&1
  echo "rc=$?" >> "$R"
  grep -h "draining in-flight\|copied DRAM blocks\|stop-time flush\|engine released\|kvnode stopped" "$dir"/old.log 2>/dev/null \
    | sed 's/^/  old log: /' | cut -c1-330 >> "$R"
  grep -h "took over the DRAM\|spill tier recovered\|kvnode ready" "$dir"/new.log 2>/dev/null \
    | sed 's/^/  new log: /' | cut -c1-330 >> "$R"
  rm -rf "$dir"
done
echo "== end $(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s" >> "$R"
tail -c 7000 "$R"
