#!/bin/bash
# Issue 42 item 1 on the lent GPU host (16 cores, 125 GiB RAM): the takeover's service gap
# with clients issuing requests across it, new build (pre-copy rounds) against old, 1M / 4M /
# 10M blocks of 4 KiB, within the device's 10-minute command limit (each run has its own
# timeout; the old build at 10M runs only if the rest left time for it). Run from the repo
# root with kvnode-new.xz and kvnode-old.xz (stripped release builds of `-p kvnode`) beside
# it: bash benches/results/2026-12-07-takeover-gap-h200/device.sh
# Output: $OUT/raw.txt (each run's report, the largest intervals between answers, where the
# barrier fell (from the daemons' logs) and the daemons' takeover log lines).
set -u
T0=$(date +%s)
xz -d -c kvnode-new.xz > /tmp/kn && xz -d -c kvnode-old.xz > /tmp/ko && chmod +x /tmp/kn /tmp/ko
R=$OUT/raw.txt
{ echo "== host $(date -u +%FT%TZ)"; nproc; free -g; /tmp/kn --version; /tmp/ko --version; } >> "$R" 2>&1
barrier() { # spawn-unix-seconds log-dir
  command -v python3 > /dev/null || return 0
  python3 - "$1" "$2" <<'PY'
import sys, re, datetime
spawn = float(sys.argv[1]); d = sys.argv[2]
def at(pat, f):
    for l in open(f, errors="replace"):
        if re.search(pat, l):
            t = datetime.datetime.fromisoformat(l.split()[0].replace("Z", "+00:00"))
            return (t.timestamp() - spawn) * 1e3
    return float("nan")
stop = at("takeover: draining in-flight requests", d + "/old.log")
took = at("took over the DRAM tier", d + "/new.log")
print(f"  barrier: donor stops accepting at {stop:.0f} ms, successor took over at {took:.0f} ms after the spawn")
PY
}
for spec in "new 1000000 100" "old 1000000 100" "new 4000000 150" "old 4000000 170" "new 10000000 200" "old 10000000 240"; do
  set -- $spec; who=$1; n=$2; limit=$3; d=/tmp/kn; [ "$who" = old ] && d=/tmp/ko
  left=$(( 570 - ($(date +%s) - T0) ))
  if [ "$left" -lt "$limit" ]; then
    echo "== $who $n blocks skipped: ${left} s left of the 10 minutes" >> "$R"
    continue
  fi
  dram=$(( (n * 4096 * 5 / 4) / 1048576 + 256 ))MiB
  dir=/tmp/tk/run-$who-$n
  echo "== $who $n blocks, dram $dram, $(date -u +%FT%TZ)" >> "$R"
  echo "\$ kvnode bench restart --mode takeover --blocks $n --block-bytes 4KiB --dram $dram --load-clients 2 --daemon $who" >> "$R"
  out=$(timeout "$limit" /tmp/kn bench restart --mode takeover --blocks "$n" --block-bytes 4KiB --dram "$dram" \
    --load-clients 2 --daemon "$d" --dir "$dir" 2>&1)
  echo "rc=$?" >> "$R"
  echo "$out" >> "$R"
  s=$(echo "$out" | sed -n 's/^successor spawned at unix \([0-9.]*\) s/\1/p')
  [ -n "$s" ] && barrier "$s" "$dir" >> "$R" 2>&1
  grep -h "live image taken\|built the DRAM\|pre-copy\|applied the slots\|took over the DRAM\|handed over" "$dir"/*.log \
    | sed 's/^/  log: /' | cut -c1-330 >> "$R"
  rm -rf "$dir"
done
tail -c 8000 "$R"
