#!/bin/sh
# Issue 43 item 4: the pulls arm with the hinted pull started when the router places a request
# (`--prefetch-at placement`: a kv.prefetch, now sent through the router entry: see
# ../2026-12-06-router-entry) against when
# the engine schedules it (`schedule`: the get's kv.fetch hint), engines held for their
# MODELLED prefill / speedup so requests queue. 2 nodes x 4 engines, 32,000 DRAM blocks per
# node, 1,000 GPU blocks per engine, LRU, round-robin; the first 2,000 requests of the
# conversation trace (669 s of it) replayed 10x faster.
# IN_FLIGHT=64 (default): the router places every request at its arrival and it queues at its
# engine. IN_FLIGHT=4: the router waits for a slot on the chosen engine, so most of the queue
# is before placement (and before the prefetch).
# Run from the repository root after `cargo build --release -p kvnode`; ~2.5 min per pair.
set -e
OUT=benches/results/2026-12-06-prefetch
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
SPEEDUP=${SPEEDUP:-10}
EPN=${EPN:-4}
IN_FLIGHT=${IN_FLIGHT:-64}
for at in schedule placement; do
  KVNODE_TEST_SEAMS=1 ./target/release/kvnode bench replay --trace $TR/conversation_trace.jsonl \
    --requests 2000 --speedup $SPEEDUP --in-flight $IN_FLIGHT --nodes 2 --engines-per-node $EPN \
    --dram-blocks 32000 --gpu-blocks 1000 --policy lru --placement rr --arm pulls \
    --hold-prefill --prefetch-at $at --json > $OUT/pulls-$at-${EPN}e-if$IN_FLIGHT-x$SPEEDUP.txt
done
