#!/bin/sh
# Issue 43 item 4: the pulls arm with the hinted pull started when the router places a request
# (`--prefetch-at placement`: an Act with kv.prefetch to the destination's daemon) against when
# the engine schedules it (`schedule`: the get's kv.fetch hint), engines held for their
# MODELLED prefill / speedup so requests queue. 2 nodes x $EPN engines (default 4), 32,000 DRAM blocks per
# node, 1,000 GPU blocks per engine, LRU, round-robin; the first 2,000 requests of the
# conversation trace (669 s of it) replayed 10x faster, at most 4 requests per engine.
# Also run with EPN=2 (saturated: queues grow through the run).
# Run from the repository root after `cargo build --release -p kvnode`.
set -e
OUT=benches/results/2026-12-06-prefetch
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
SPEEDUP=${SPEEDUP:-10}
EPN=${EPN:-4}
for at in schedule placement; do
  KVNODE_TEST_SEAMS=1 ./target/release/kvnode bench replay --trace $TR/conversation_trace.jsonl \
    --requests 2000 --speedup $SPEEDUP --in-flight 4 --nodes 2 --engines-per-node $EPN \
    --dram-blocks 32000 --gpu-blocks 1000 --policy lru --placement rr --arm pulls \
    --hold-prefill --prefetch-at $at --json > $OUT/pulls-$at-${EPN}e-x$SPEEDUP.txt
done
