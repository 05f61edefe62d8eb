#!/bin/bash
# Issue 42 on the lent GPU host (16 cores, 125 GiB RAM): takeover service gap with clients
# issuing requests across it, new build against old, at 10M / 4M / 1M blocks of 4 KiB, plus the
# index figures of item 3 (heap per block, single-key exists/get/put p50/p99 after the fill,
# --probes) at 10k / 1M / 4M / 10M, and (SPECS=...) spill recovery and events runs.
# Run from the repo root with bin/kvnode-new.xz and bin/kvnode-old.xz (stripped release builds
# of `-p kvnode`):  SPECS="..." bash benches/results/2026-12-07-takeover-10m/device.sh
# A spec is "who blocks limit_s mode [extra flags...]" separated by ';'. Each run has its own
# timeout; a run whose limit does not fit the call's remaining time (BUDGET_S, default 560) is
# skipped and says so. Output: $OUT/raw-$TAG.txt.
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
  set -- $spec; who=$1; n=$2; limit=$3; mode=$4; shift 4
  d=/tmp/kn; [ "$who" = old ] && d=/tmp/ko
  left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$limit" ]; then
    echo "== $who $n $mode $* skipped: ${left} s left of the call" >> "$R"
    continue
  fi
  case "$mode" in
    takeover) dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB ;;
    *) dram=${SPILL_DRAM:-4GiB} ;;
  esac
  dir=/tmp/tk/run-$who-$n-$mode
  echo "== $who $n blocks, mode $mode, dram $dram, $(date -u +%FT%TZ)" >> "$R"
  echo "\$ kvnode bench restart --mode $mode --blocks $n --block-bytes 4KiB --dram $dram --daemon $who $*" >> "$R"
  timeout "$limit" /tmp/kn bench restart --mode "$mode" --blocks "$n" --block-bytes 4KiB --dram "$dram" \
    --daemon "$d" --dir "$dir" "$@" >> "$R" 2>&1
  echo "rc=$?" >> "$R"
  grep -h "live image taken\|built the DRAM\|pre-copy\|applied the slots\|took over the DRAM\|handed over\|draining in-flight\|spill tier recovered\|flushed\|kvnode ready\|kvnode stopped" "$dir"/*.log 2>/dev/null \
    | sed 's/^/  log: /' | cut -c1-330 >> "$R"
  rm -rf "$dir"
done
echo "== end $(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s" >> "$R"
tail -c 6000 "$R"
