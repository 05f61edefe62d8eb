#!/bin/bash
# Issue 42 item 1 on the lent GPU host (16 cores, 125 GiB RAM): the takeover's service gap
# with clients issuing requests across it, new build against old, 1M / 4M / 10M blocks of
# 4 KiB. Run from the repo root with kvnode-new.xz and kvnode-old.xz (stripped release
# builds) beside it: bash benches/results/2026-12-07-takeover-gap-h200/device.sh
# Output: $OUT/raw.txt (each run's report and the daemons' takeover log lines).
set -u
xz -d -c kvnode-new.xz > /tmp/kn && xz -d -c kvnode-old.xz > /tmp/ko && chmod +x /tmp/kn /tmp/ko
R=$OUT/raw.txt
{ echo "== host $(date -u +%FT%TZ)"; nproc; free -g; /tmp/kn --version; /tmp/ko --version; } >> "$R" 2>&1
for spec in "new 1000000" "old 1000000" "new 4000000" "old 4000000" "new 10000000"; do
  set -- $spec; who=$1; n=$2; d=/tmp/kn; [ "$who" = old ] && d=/tmp/ko
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  dir=/tmp/tk/run-$who-$n
  echo "== $who $n blocks, dram $dram, $(date -u +%FT%TZ)" >> "$R"
  echo "\$ kvnode bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $who" >> "$R"
  timeout 280 /tmp/kn bench restart --mode takeover --blocks "$n" --block-bytes 4KiB --dram "$dram" \
    --load-clients 2 --daemon "$d" --dir "$dir" >> "$R" 2>&1
  echo "rc=$?" >> "$R"
  grep -h "live image taken\|built the DRAM\|applied the slots\|took over the DRAM\|handed over" "$dir"/*.log \
    | sed 's/^/  log: /' | cut -c1-330 >> "$R"
  rm -rf "$dir"
done
tail -c 6000 "$R"
