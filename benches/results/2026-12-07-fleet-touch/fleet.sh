#!/bin/sh
# Issue 40's fleet row under round-robin with the two behaviours that lift pulls (pulled blocks
# announced with their source's metadata; engines touch their GPU hits), and the pulls arm
# without them, same trace slice and flags as benches/results/2026-12-06-vm-replay/fleet.sh:
# 2 nodes x 8 engines, 32,000 DRAM blocks per node, 1,000 GPU blocks per engine, LRU, the
# first 6,000 conversation requests at 30x, 2 in flight per engine. KVNODE=a seams-free
# `cargo build --release -p kvnode`.
set -e
OUT=benches/results/2026-12-07-fleet-touch
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
K=${KVNODE:-./target/release/kvnode}
A="--trace $TR/conversation_trace.jsonl --requests 6000 --speedup 30 --in-flight 2 --nodes 2 --engines-per-node 8 --dram-blocks 32000 --gpu-blocks 1000 --policy lru --placement rr"
$K bench replay $A --arm gpu,private,shared,pulls --json --svg $OUT/fleet-rr-lru.svg > $OUT/fleet-rr-lru.txt
$K bench replay $A --arm pulls --without touch-gpu-hits --json > $OUT/fleet-rr-lru-without-touch.txt
$K bench replay $A --arm pulls --model --json > $OUT/model-rr-lru.txt
$K bench replay $A --arm pulls --model --without touch-gpu-hits,announce-pulled --json > $OUT/model-rr-lru-without-both.txt
for pl in least-loaded affinity; do
  B="--trace $TR/conversation_trace.jsonl --requests 6000 --speedup 30 --in-flight 2 --nodes 2 --engines-per-node 8 --dram-blocks 32000 --gpu-blocks 1000 --policy lru --placement $pl"
  $K bench replay $B --arm gpu,private,shared,pulls --json --svg $OUT/fleet-$pl-lru.svg > $OUT/fleet-$pl-lru.txt
done
