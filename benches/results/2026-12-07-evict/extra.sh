#!/bin/sh
# The rows where chain is below LRU offline, through one real daemon (as rows.sh): the
# synthetic trace's tuning half (its first 1,925 requests: the trace is in time order, and
# the half is split at the middle of its time span) at 2,000 blocks, and the whole
# conversation trace at 64,000 blocks.
set -e
OUT=benches/results/2026-12-07-evict
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
for p in lru chain; do
  for row in synthetic:2000:1925 conversation:64000:12031; do
    t=$(echo $row | cut -d: -f1); c=$(echo $row | cut -d: -f2); n=$(echo $row | cut -d: -f3)
    KVNODE_TEST_SEAMS=1 ${KVNODE:-./target/release/kvnode} bench replay --trace $TR/${t}_trace.jsonl \
      --requests $n --nodes 1 --engines-per-node 1 --gpu-blocks 0 --dram-blocks $c --arm shared \
      --policy $p --deterministic --json > $OUT/row-$t-$c-first$n-$p.txt
  done
done
