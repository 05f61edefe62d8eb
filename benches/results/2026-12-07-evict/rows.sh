#!/bin/sh
# Issue 40's six rows (and the policies' offline figure beside each: policy_hit_rate) through one real daemon (one node, one engine, no GPU cache),
# deterministic: the whole trace, one request at a time. Run from the repository root after
# `cargo build --release -p kvnode -p kvnode-e2e --bins --tests` (a test-seam build, hence
# KVNODE_TEST_SEAMS=1).
set -e
OUT=benches/results/2026-12-07-evict
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
POLICIES=${POLICIES:-"lru chain"}
for p in $POLICIES; do
  for row in conversation:2000 conversation:8000 conversation:32000 synthetic:1000 synthetic:4000 synthetic:16000; do
    t=${row%%:*}; c=${row##*:}
    KVNODE_TEST_SEAMS=1 ${KVNODE:-./target/release/kvnode} bench replay --trace $TR/${t}_trace.jsonl \
      --nodes 1 --engines-per-node 1 --gpu-blocks 0 --dram-blocks $c --arm shared \
      --policy $p --deterministic --json > $OUT/row-$t-$c-$p.txt
  done
done
