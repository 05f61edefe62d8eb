#!/usr/bin/env bash
# Issue 44 §3 (layer-wise onload at the copy limit), as sent to the lent GPU machine in ONE call:
#   1. the copy plans measured without the daemon (engine/gpu/examples/layer_onload.rs: pinned
#      memcpy, page by page, layer-wise in page order (before) and in runs (after), fences,
#      arena registered in 1 GiB pieces, 4 GiB pieces, one range), all on this card;
#   2. the long prefix (32k tokens + 64) through the daemon built before and after the change,
#      ABBA (old, new, new, old) on the same card, each run with its own same-run memcpy and
#      the correctness section (DRAM and layer-wise paths: KV pages and logits bitwise).
# Runs from a directory D holding bench/ttft, clients/python, scripts/bench-ttft.sh and
# bin/{kvnode-old,kvnode-new,layer_onload} (stripped release builds; *.gz unpacked here).
# Output: $OUT/lw.log, $OUT/lw.tgz (layer_onload.txt; per run report.md, summary.json,
# results.json, console log).
set -u -o pipefail
D=$(cd "$(dirname "$0")/../.." && pwd)
R=/tmp/issue44-lw
mkdir -p "$R"
LOG=$OUT/lw.log
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
pack() { (cd "$R" && tar czf "$OUT/lw.tgz" --exclude='daemon-*.log' .); }
for f in "$D"/bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x "$D"/bin/*
say "host"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader; nproc; free -g | head -2; "$D/bin/kvnode-old" --version; "$D/bin/kvnode-new" --version; } 2>&1 | tee -a "$LOG"
say "copy plans without the daemon"
"$D/bin/layer_onload" "${REPS:-7}" 2>&1 | tee -a "$LOG" "$R/layer_onload.txt"
pack
# Only the DRAM paths of the long prefix (no NVMe, no peers) and of the correctness section;
# small arenas for the daemons the run does not use, so registration is short.
A=(--phases 1 --sections memcpy,correctness,long_prefix --set 'daemons.d1="16GiB"'
   --set 'daemons.d2="1GiB"' --set 'daemons.d2_spill="2GiB"' --set 'daemons.ea="1GiB"' --set 'daemons.eb="1GiB"'
   --set 'long_prefix.only=["dram","dram_page_first","dram_layerwise"]'
   --set 'correctness.only=["dram","dram_layerwise"]')
run() {  # name, binary
  say "long prefix, run $1 ($2)"
  KVNODE_BIN=$D/bin/$2 OUT=$R/$1 bash "$D/scripts/bench-ttft.sh" h200 "${A[@]}" > "$R/$1.console" 2>&1
  say "run $1 rc=$?"
  grep -E "^\| (recompute|gpu_cached|dram|DRAM)|Pinned copy|bitwise" "$R/$1/report.md" 2>/dev/null | tee -a "$LOG"
  pack
}
run 1-old kvnode-old
run 2-new kvnode-new
run 3-new kvnode-new
run 4-old kvnode-old
say "done"
pack
