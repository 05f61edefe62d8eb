#!/usr/bin/env bash
# The kvnode image run the way the DaemonSet runs it (docs/deploy.md), with podman on this
# machine: the socket directory and the spill directory bind-mounted as hostPaths are, the
# entrypoint's state dir as the pod's emptyDir, a read-only root file system, every
# capability dropped but IPC_LOCK, the runtime's seccomp profile plus io_uring
# (packaging/image/seccomp.py). A client on the host (target/release/kvnode):
#   1. puts 8 pages of 1 MiB from a file and gets them back inline and zero-copy (the lease
#      reads the daemon's arena through the memfd it passed out of the container): same bytes;
#   2. `kvnode stats` and /metrics answer; the arena is pinned (IPC_LOCK works as non-root);
#      the image's health check passes;
#   3. a second container started with --takeover on the same socket and takeover directories
#      (the takeover socket in /run/kvnode-admin, not beside the client socket) takes the
#      DRAM tier over: every block still in DRAM, same bytes, no block read from NVMe; the
#      first container's entrypoint then waits (unhealthy) and, restarted, does not take the
#      tier back; stopped, it exits 0;
#   4. SIGTERM (podman stop) stops the second cleanly (exit 0) with the stop-time flush, and a
#      third container on the same spill directory starts cold and serves every block;
#   5. a fourth container takes the third's tier over while two clients on the host keep
#      issuing requests (`kvnode bench load`: gets with their bytes checked, puts, a request
#      the hand-over cut retried on a new connection): none fails, every block put during the
#      hand-over is read back; the service gap they saw is printed (docs/benchmarks.md).
# Needs root, podman + runc, and the image (scripts/build-image.sh). Run: tests/deploy/run.sh
source "$(dirname "$0")/lib.sh"
podman image exists "$IMAGE" || fail "image $IMAGE missing: run scripts/build-image.sh"
dir=$(scratch container)
names=()
cleanup() {
  for n in "${names[@]}"; do podman rm -f -t 0 "$n" >/dev/null 2>&1 || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
# podman's default seccomp profile refuses io_uring: the spill tier's profile adds it.
python3 "$ROOT/packaging/image/seccomp.py" >"$dir/seccomp.json"
install -d -o 10001 -g 10001 -m 0750 "$dir/sock" "$dir/spill" "$dir/state-a" "$dir/state-b" "$dir/state-c" "$dir/state-d"
install -d -o 10001 -g 10001 -m 0700 "$dir/admin"
sock=$dir/sock/kvnode.sock
port=$(free_port)
tag=$$
# Same flags for every container: a takeover needs the same DRAM layout.
serve=(serve --config /etc/kvnode/kvnode.toml --takeover --dram 64MiB --slab-size 2MiB
  --spill-dir /var/lib/kvnode/spill --spill-size 256MiB --metrics "127.0.0.1:$port")
run_pod() { # NAME STATE-DIR: a detached container like the DaemonSet's pod
  names+=("$1")
  "${PODMAN_RUN[@]}" -d --name "$1" --network host --read-only \
    --cap-drop ALL --cap-add IPC_LOCK --security-opt "seccomp=$dir/seccomp.json" \
    -v "$dir/sock:/run/kvnode" -v "$dir/admin:/run/kvnode-admin" -v "$dir/spill:/var/lib/kvnode/spill" \
    -v "$2:/var/lib/kvnode-pod" "$IMAGE" "${serve[@]}" 2> >(quiet >&2) >/dev/null
}
# podman without systemd says at every start and stop that it cannot set a timer for the
# image's health check; the test runs the check itself (podman healthcheck run).
quiet() { grep -v "unable to get systemd connection" || true; }
logs() { podman logs "$1" 2>&1 | sed 's/\x1b\[[0-9;]*m//g'; }
pages=8
tokens=$(seq -s, 1 $((pages * 64)))
keys=(--tokens "$tokens" --model deploy-test --page-size 64 --page-bytes 1MiB)
head -c $((pages << 20)) /dev/urandom >"$dir/pages.bin"

step "container A serves"
run_pod "kvnode-a-$tag" "$dir/state-a"
wait_socket "$sock" 30 || { logs "kvnode-a-$tag" | tail -30; fail "container A never answered on $sock"; }
[ "$(podman inspect --format '{{.Config.User}}' "kvnode-a-$tag")" = "10001:10001" ] || fail "the image does not run as the kvnode user"
"$KVNODE" put --socket "$sock" "${keys[@]}" --file "$dir/pages.bin" | grep -q "^stored $pages" ||
  fail "put of $pages pages failed"
"$KVNODE" get --socket "$sock" "${keys[@]}" --out "$dir/inline.bin" >/dev/null
"$KVNODE" get --socket "$sock" "${keys[@]}" --zero-copy --out "$dir/zc.bin" >/dev/null
cmp "$dir/pages.bin" "$dir/inline.bin" || fail "inline get returned other bytes"
cmp "$dir/pages.bin" "$dir/zc.bin" || fail "zero-copy get (arena memfd from the container) returned other bytes"

step "stats, /metrics, pinning, health check"
"$KVNODE" stats --socket "$sock" | grep -q dram || fail "kvnode stats has no dram tier"
pid_a=$(stat_of "$sock" "s['pid']")
[ "$(stat_of "$sock" "next(t['blocks'] for t in s['tiers'] if t['tier']=='dram')")" = "$pages" ] || fail "stats: not $pages DRAM blocks"
metrics=$(http_get "127.0.0.1:$port/metrics") || fail "/metrics does not answer"
grep -q '^kvnode_tier_blocks{tier="dram"} '"$pages"'$' <<<"$metrics" || fail "/metrics: kvnode_tier_blocks{tier=\"dram\"} is not $pages"
for ((i = 0; i < 100; i++)); do
  [ "$(stat_of "$sock" "next(t['pinned_bytes'] for t in s['tiers'] if t['tier']=='dram')")" = $((64 << 20)) ] && break
  sleep 0.1
done
[ "$i" -lt 100 ] || { logs "kvnode-a-$tag" | tail -30; fail "the arena was not pinned with IPC_LOCK as the non-root kvnode user"; }
podman healthcheck run "kvnode-a-$tag" >/dev/null || fail "the health check of a serving container fails"

step "container B takes the DRAM tier over"
run_pod "kvnode-b-$tag" "$dir/state-b"
for ((i = 0; i < 300; i++)); do
  [ -e "$dir/state-a/handed-over" ] && break
  sleep 0.1
done
[ -e "$dir/state-a/handed-over" ] || { logs "kvnode-a-$tag" | tail -20; logs "kvnode-b-$tag" | tail -20; fail "A never handed its tier over"; }
wait_socket "$sock" 10 || fail "nothing answers after the takeover"
logs "kvnode-b-$tag" | grep -q "took_over=true" || { logs "kvnode-b-$tag" | tail -30; fail "B did not report a takeover"; }
[ "$(stat_of "$sock" "next(t['blocks'] for t in s['tiers'] if t['tier']=='dram')")" = "$pages" ] || fail "after the takeover: not $pages DRAM blocks"
"$KVNODE" get --socket "$sock" "${keys[@]}" --zero-copy --out "$dir/zc-b.bin" >/dev/null
cmp "$dir/pages.bin" "$dir/zc-b.bin" || fail "after the takeover the blocks have other bytes"
[ "$(stat_of "$sock" "next(t['promotions'] for t in s['tiers'] if t['tier']=='nvme')")" = 0 ] || fail "after the takeover blocks came from NVMe, not the handed-over arena"
[ "$(podman inspect --format '{{.State.Running}}' "kvnode-a-$tag")" = true ] || fail "A's entrypoint exited after handing over (a runtime would restart it)"
if podman healthcheck run "kvnode-a-$tag" >/dev/null 2>&1; then fail "A is still healthy after handing over"; fi
podman healthcheck run "kvnode-b-$tag" >/dev/null || fail "B is not healthy"

step "A restarted does not take the tier back"
podman stop -t 10 "kvnode-a-$tag" 2> >(quiet >&2) >/dev/null
[ "$(podman inspect --format '{{.State.ExitCode}}' "kvnode-a-$tag")" = 0 ] || fail "A did not exit 0 when stopped"
pid_b=$(stat_of "$sock" "s['pid']")
podman start "kvnode-a-$tag" 2> >(quiet >&2) >/dev/null
sleep 2
logs "kvnode-a-$tag" | grep -q "handed its daemon over to a successor" || { logs "kvnode-a-$tag" | tail -30; fail "restarted A did not see its hand-over record"; }
[ "$(podman inspect --format '{{.State.Running}}' "kvnode-b-$tag")" = true ] || fail "B stopped after A restarted"
[ "$(stat_of "$sock" "s['pid']")" = "$pid_b" ] && [ "$(stat_of "$sock" "round(s['uptime_s'])")" -ge 2 ] ||
  fail "B no longer serves the socket after A restarted"
podman stop -t 10 "kvnode-a-$tag" 2> >(quiet >&2) >/dev/null

step "SIGTERM stops B cleanly, the spill tier keeps every block"
podman stop -t 60 "kvnode-b-$tag" 2> >(quiet >&2) >/dev/null
[ "$(podman inspect --format '{{.State.ExitCode}}' "kvnode-b-$tag")" = 0 ] || { logs "kvnode-b-$tag" | tail -30; fail "B did not exit 0 on SIGTERM"; }
logs "kvnode-b-$tag" | grep -q "kvnode stopped" || fail "B's log has no clean stop"
[ ! -e "$sock" ] || fail "B left its socket behind"
run_pod "kvnode-c-$tag" "$dir/state-c"
wait_socket "$sock" 30 || { logs "kvnode-c-$tag" | tail -30; fail "C never answered"; }
logs "kvnode-c-$tag" | grep -q "took_over=false" || fail "C did not start cold"
got=$("$KVNODE" get --socket "$sock" "${keys[@]}" --out "$dir/c.bin")
grep -q "^$pages of $pages leading pages hit" <<<"$got" || {
  logs "kvnode-b-$tag" | grep -i "flush\|stop" >&2
  logs "kvnode-c-$tag" | grep -i "spill\|recover" >&2
  fail "after SIGTERM and a cold start not every block is there: $got"
}
cmp "$dir/pages.bin" "$dir/c.bin" || fail "after SIGTERM and a cold start the blocks have other bytes"

step "D takes C's tier over while two clients keep issuing requests (a rolling update's hand-over)"
"$KVNODE" bench load --socket "$sock" --blocks 2000 --block-bytes 4KiB --clients 2 \
  --until "$dir/state-c/handed-over" --after-s 2 --timeout-s 120 >"$dir/load.txt" 2>&1 &
load_pid=$!
for ((i = 0; i < 100; i++)); do
  grep -q "^load started" "$dir/load.txt" && break
  sleep 0.1
done
grep -q "^load started" "$dir/load.txt" || { cat "$dir/load.txt"; fail "the load never started against C"; }
run_pod "kvnode-d-$tag" "$dir/state-d"
wait "$load_pid" || { cat "$dir/load.txt"; logs "kvnode-d-$tag" | tail -20; fail "across D's takeover a request failed or a block put was lost"; }
logs "kvnode-d-$tag" | grep -q "took_over=true" || { logs "kvnode-d-$tag" | tail -30; fail "D did not take C's tier over"; }
grep "^load across\|^largest" "$dir/load.txt"
echo "ok: container (image $IMAGE, daemon pids A $pid_a, B $pid_b)"
