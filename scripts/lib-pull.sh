# Sourced by scripts/bench-pull-cpu.sh and scripts/profile-pull.sh: a long `kvnode bench pull`
# (two daemons it starts, 64 x 1 MiB pulls) to measure the daemons in the middle of.
#   pull_args "$@"          BIN [CONNECTIONS] [SERVE_FLAG...] -> $bin, $conns, $dargs
#   pull_start DIR          starts the bench; sets $bench, $src, $dst (daemon pids), $sock
#   pull_inserts            blocks the destination has stored so far
pull_args() {
  bin=$(realpath "${1:-target/release/kvnode}")
  conns=${2:-${DEFAULT_CONNECTIONS:-2}}
  shift $(( $# < 2 ? $# : 2 ))
  dargs=()
  for f in "$@"; do dargs+=("--daemon-arg=$f"); done
}
pull_start() {
  "$bin" bench pull --rounds 1 --iterations 600 --latency-samples 1 --iperf-seconds 0 \
    --connections "$conns" ${dargs[@]+"${dargs[@]}"} >"$1/bench.txt" 2>&1 &
  bench=$!
  sleep 4
  src=$(pgrep -P "$bench" -f 'serve.*--peer-listen')
  dst=$(pgrep -P "$bench" -f 'serve.*--peers')
  sock=$(tr '\0' '\n' <"/proc/$dst/cmdline" | grep -A1 -x -- --socket | tail -1)
}
pull_inserts() {
  "$bin" stats --socket "$sock" --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["stats"]["tiers"][0]["inserts"])'
}
