#!/bin/bash
# Issue 27 §1 with real daemons (what a new user tried). Usage: scripts/repro-long-get.sh KVNODE_BIN
# Issue 27 §1 with real daemons: 64 MiB DRAM, 1 GiB spill, put 1024 x 256 KiB, get them.
set -u
BIN=${1:?kvnode binary}
D=$(mktemp -d /var/tmp/kvnode-repro.XXXXXX)
S=$D/kv.sock
"$BIN" serve --socket "$S" --dram 64MiB --no-pin --spill-dir "$D/spill" --spill-size 1GiB >"$D/log" 2>&1 &
P=$!
until "$BIN" stats --socket "$S" >/dev/null 2>&1; do sleep 0.05; done
T=$(seq -s, 1 1024)
A=(--socket "$S" --page-size 1 --page-bytes 256KiB --tokens "$T")
"$BIN" put "${A[@]}" --seed 7 | tail -2
"$BIN" get "${A[@]}" --out "$D/got.bin"
"$BIN" get "${A[@]}" --zero-copy
kill $P; wait $P 2>/dev/null
rm -rf "$D"
