#!/bin/bash
# Issue 27 §1 end to end: 64 MiB DRAM, 1 GiB spill, put 256 MiB of random pages, get them inline and
# zero-copy (split on TooLarge), compare with the input. Usage: scripts/verify-long-get.sh KVNODE_BIN
set -u
BIN=$1
D=$(mktemp -d /var/tmp/kvnode-verify.XXXXXX)
S=$D/kv.sock
head -c $((1024*256*1024)) /dev/urandom > $D/in.bin
"$BIN" serve --socket "$S" --dram 64MiB --no-pin --spill-dir "$D/spill" --spill-size 1GiB >"$D/log" 2>&1 &
P=$!
until "$BIN" stats --socket "$S" >/dev/null 2>&1; do sleep 0.05; done
T=$(seq -s, 1 1024)
A=(--socket "$S" --page-size 1 --page-bytes 256KiB --tokens "$T")
"$BIN" put "${A[@]}" --file $D/in.bin | tail -1
"$BIN" get "${A[@]}" --out "$D/inline.bin" | head -1
"$BIN" get "${A[@]}" --zero-copy --out "$D/lease.bin" | head -1
cmp $D/in.bin $D/inline.bin && echo "inline: byte-identical, in order"
cmp $D/in.bin $D/lease.bin && echo "zero-copy (split on TooLarge): byte-identical, in order"
"$BIN" stats --socket "$S" | grep -iE "promot|lease|nvme" | head -6
kill $P; wait $P 2>/dev/null; rm -rf "$D"
