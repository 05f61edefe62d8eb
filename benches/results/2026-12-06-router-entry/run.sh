#!/bin/sh
# Issue 43 item 4 through the router entry: the pulls arm with the hinted pull started when
# the router places a request (`--prefetch-at placement`: a signed POST /v1/act with one
# kv.prefetch to the destination daemon's `--router-listen`, which resolves the router hashes
# at the source and pulls) against when the engine schedules it (`schedule`: the get's
# kv.fetch hint), engines held for their MODELLED prefill / speedup so requests queue.
# Blocks of 256 KiB (`--block-bytes`) so a pulled prefix takes milliseconds on loopback.
# Default regime (EPN=2, DRAM=16000): 2 nodes x 2 engines, 16,000 DRAM blocks per node
# (4 GiB), loaded enough that most requests queue for longer than a pull. EPN=4 DRAM=8000:
# 2 nodes x 4 engines, 8,000 blocks (2 GiB), where most requests do not queue at all.
# 1,000 GPU blocks per engine, LRU, round-robin, 64 in flight per engine (the router places
# every request at its arrival); the first 2,000 requests of the conversation trace (669 s of
# it) replayed 5x faster. Each setting twice, interleaved (schedule, placement, schedule,
# placement); REPS="1" for one of each.
# Run from the repository root after `cargo build --release -p kvnode`; ~2.5 min per run.
set -e
OUT=benches/results/2026-12-06-router-entry
TR=${KVNODE_TRACES:-../shared/traces}/mooncake_fast25
SPEEDUP=${SPEEDUP:-5}
BLOCK=${BLOCK:-256KiB}
REQUESTS=${REQUESTS:-2000}
EPN=${EPN:-2}
DRAM=${DRAM:-16000}
for rep in ${REPS:-1 2}; do
  for at in schedule placement; do
    KVNODE_TEST_SEAMS=1 ./target/release/kvnode bench replay --trace $TR/conversation_trace.jsonl \
      --requests $REQUESTS --speedup $SPEEDUP --in-flight 64 --nodes 2 --engines-per-node $EPN \
      --dram-blocks $DRAM --gpu-blocks 1000 --block-bytes $BLOCK --policy lru --placement rr \
      --arm pulls --hold-prefill --prefetch-at $at --json \
      > $OUT/pulls-$at-${EPN}e-$BLOCK-x$SPEEDUP-$rep.txt
  done
done
