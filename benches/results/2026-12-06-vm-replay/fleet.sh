#!/bin/sh
# Issue 40's fleet table: 2 nodes x 8 engines, 32,000 DRAM blocks per node (4,000 per engine
# in the private arm), 1,000 GPU blocks per engine, LRU; the four arms under each placement.
# Cut to fit a 2-core VM: the first 6,000 requests of the conversation trace (29 of its 59
# minutes), replayed 30x faster than recorded, at most 2 requests in flight per engine.
set -e
OUT=benches/results/2026-12-06-vm-replay
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
POLICY=${POLICY:-lru}
for pl in rr least-loaded affinity; do
  KVNODE_TEST_SEAMS=1 ./target/release/kvnode bench replay --trace $TR/conversation_trace.jsonl \
    --requests 6000 --speedup 30 --in-flight 2 --nodes 2 --engines-per-node 8 \
    --dram-blocks 32000 --gpu-blocks 1000 --policy $POLICY --placement $pl \
    --arm gpu,private,shared,pulls --json --svg $OUT/fleet-$pl-$POLICY.svg > $OUT/fleet-$pl-$POLICY.txt
done
