#!/usr/bin/env bash
# Issue 38 item 2 replayed: an engine pod beside the daemon tries to take the daemon's arena
# over or to put a relay in place of its socket. The node's layout is the DaemonSet's
# (deploy/base: /run/kvnode for the client socket, /run/kvnode-admin for the takeover socket,
# the daemon container as in container.sh, its tenant map the ConfigMap's [tenants]); each
# engine container is started with what its pod spec says (deploy/engines/*-pod.yaml, read
# here: runAsUser/runAsGroup, supplementalGroups, the socket directory's hostPath mount and
# its readOnly, drop ALL, no privilege escalation), on the kvnode image (the engines' images
# come from a registry CI cannot reach; the kvnode CLI in it is the attacker's tool).
# In each engine container, as the pod's uid and again as root (an engine image's default
# user before issue 38):
#   1. the socket directory shows the client socket only (no takeover socket to connect to);
#   2. `kvnode serve --takeover` on the client socket takes nothing over (no takeover socket
#      reachable) and cannot bind a socket of its own there;
#   3. the client socket cannot be removed, renamed or shadowed (read-only mount);
#   4. as the pod's uid the engine puts and gets its own blocks (its tenant); as root it is
#      refused at accept (no tenant).
# After all of it the daemon is the same process (pid), serves, and holds every block.
# Needs root, podman + runc, the image, the deploy venv (PyYAML). Run: tests/deploy/run.sh
source "$(dirname "$0")/lib.sh"
podman image exists "$IMAGE" || fail "image $IMAGE missing: run scripts/build-image.sh"
py=$(bash "$ROOT/scripts/install-deploy-deps.sh" --print-venv)/bin/python
dir=$(scratch engines)
# Engine and daemon uids reach the socket directory inside it from the host too.
chmod 0755 "$dir"
names=()
cleanup() {
  for n in "${names[@]}"; do podman rm -f -t 0 "$n" >/dev/null 2>&1 || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
python3 "$ROOT/packaging/image/seccomp.py" >"$dir/seccomp.json"
install -d -o 10001 -g 10001 -m 0750 "$dir/sock" "$dir/state"
install -d -o 10001 -g 10001 -m 0700 "$dir/admin"
sock=$dir/sock/kvnode.sock
tag=$$
# The daemon's configuration: the ConfigMap's socket, mode, takeover socket and tenant map.
"$py" - "$ROOT" >"$dir/kvnode.toml" <<'PY'
import sys, tomllib, yaml
from pathlib import Path
cm = yaml.safe_load((Path(sys.argv[1]) / "deploy/base/configmap.yaml").read_text())
cfg = tomllib.loads(cm["data"]["kvnode.toml"])
print(f'socket = "{cfg["socket"]}"\nsocket_mode = {oct(cfg["socket_mode"])}')
print(f'takeover_socket = "{cfg["takeover_socket"]}"\n\n[tenants]\nunmapped = "{cfg["tenants"]["unmapped"]}"')
for t in cfg["tenants"]["tenant"]:
    print(f'\n[[tenants.tenant]]\nname = "{t["name"]}"\nuids = {t["uids"]}')
PY
chmod 0644 "$dir/kvnode.toml"
grep -q '^takeover_socket = "/run/kvnode-admin/' "$dir/kvnode.toml" || fail "the ConfigMap's takeover socket is not in /run/kvnode-admin: $(cat "$dir/kvnode.toml")"
quiet() { grep -v "unable to get systemd connection" || true; }
logs() { podman logs "$1" 2>&1 | sed 's/\x1b\[[0-9;]*m//g'; }
# Operator commands from the host as the daemon's uid (root is no tenant of this map).
as_daemon() { setpriv --reuid 10001 --regid 10001 --clear-groups "$KVNODE" "$@"; }

step "the daemon container (DaemonSet layout, the ConfigMap's tenant map)"
names+=("kvnode-eng-d-$tag")
"${PODMAN_RUN[@]}" -d --name "kvnode-eng-d-$tag" --network none --read-only \
  --cap-drop ALL --cap-add IPC_LOCK --security-opt "seccomp=$dir/seccomp.json" \
  -v "$dir/kvnode.toml:/etc/kvnode/kvnode.toml:ro" \
  -v "$dir/sock:/run/kvnode" -v "$dir/admin:/run/kvnode-admin" -v "$dir/state:/var/lib/kvnode-pod" \
  "$IMAGE" serve --config /etc/kvnode/kvnode.toml --takeover --dram 64MiB --slab-size 2MiB \
  2> >(quiet >&2) >/dev/null
for ((i = 0; i < 300; i++)); do as_daemon stats --socket "$sock" >/dev/null 2>&1 && break; sleep 0.1; done
as_daemon stats --socket "$sock" >/dev/null || { as_daemon stats --socket "$sock"; logs "kvnode-eng-d-$tag" | tail -30; fail "the daemon never answered"; }
[ -S "$dir/admin/kvnode.sock.takeover" ] || fail "no takeover socket in the takeover directory"
pid=$(as_daemon stats --json --socket "$sock" | python3 -c "import json,sys; print(json.load(sys.stdin)['stats']['pid'])")
keys=(--model engines-test --page-size 64 --page-bytes 64KiB --tokens "$(seq -s, 1 256)")
setpriv --reuid 20001 --regid 20001 --groups 10001 "$KVNODE" put --socket "$sock" "${keys[@]}" --seed 5 |
  grep -q "^stored 4" || fail "the vLLM tenant's uid cannot put from the host"

# One line per engine pod: file uid gid groups mount_path read_only other_host_paths
"$py" - "$ROOT" >"$dir/pods" <<'PY'
import sys, yaml
from pathlib import Path
root = Path(sys.argv[1])
for f in ("deploy/engines/vllm-pod.yaml", "deploy/engines/sglang-pod.yaml"):
    pod = yaml.safe_load((root / f).read_text())["spec"]
    (c,) = pod["containers"]
    sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    vols = {v["name"]: v for v in pod["volumes"]}
    host = {m["name"]: vols[m["name"]].get("hostPath", {}).get("path") for m in c["volumeMounts"]}
    (sm,) = [m for m in c["volumeMounts"] if host[m["name"]] == "/run/kvnode"]
    others = [h for n, h in host.items() if h and h != "/run/kvnode"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False, f
    groups = ",".join(str(g) for g in pod["securityContext"].get("supplementalGroups", [])) or "-"
    print(f, sc.get("runAsUser", 0), sc.get("runAsGroup", 0), groups, sm["mountPath"],
          "ro" if sm.get("readOnly") else "rw", ",".join(others) or "-")
PY

# The attack, run inside an engine container: prints one verdict line per attempt.
cat >"$dir/attack.sh" <<'SH'
s=/run/kvnode/kvnode.sock
echo "ls: $(ls -A /run/kvnode | tr '\n' ' ')"
/usr/bin/kvnode serve --takeover --socket "$s" --dram 64MiB --slab-size 2MiB --no-pin >/tmp/t.log 2>&1 &
p=$!; sleep 3
if kill -0 $p 2>/dev/null; then echo "takeover: STILL RUNNING"; kill $p; else echo "takeover: exited"; fi
grep -q "took over the DRAM tier" /tmp/t.log && echo "takeover: TOOK OVER"
rm -f "$s" 2>/dev/null && [ ! -e "$s" ] && echo "relay: REMOVED the socket"
mv "$s" "$s.x" 2>/dev/null && echo "relay: RENAMED the socket"
touch /run/kvnode/probe 2>/dev/null && echo "relay: WROTE in the socket dir"
k="--model engines-test --page-size 64 --page-bytes 64KiB --tokens $(seq -s, 1 256)"
echo "get: $(/usr/bin/kvnode get --socket "$s" $k 2>&1 | tail -1)"
echo "put: $(/usr/bin/kvnode put --socket "$s" --model "eng-$(id -u)" --page-size 64 --page-bytes 64KiB --tokens "$(seq -s, 1 64)" --seed 1 2>&1 | tail -1)"
SH
chmod 0644 "$dir/attack.sh"

n=0
while read -r f uid gid groups mpath mode others; do
  [ "$mode" = ro ] || fail "$f mounts the socket dir writable"
  [ "$others" = - ] || fail "$f mounts other host paths: $others"
  for who in "$uid:$gid" 0:0; do
    n=$((n + 1))
    step "$f as $who: takeover, relay, use"
    args=(--rm --network none --read-only --user "$who" --cap-drop ALL --security-opt no-new-privileges
      -v "$dir/sock:$mpath:ro" -v "$dir/attack.sh:/attack.sh:ro" --entrypoint /bin/sh)
    [ "$groups" = - ] || args+=(--group-add "$groups")
    # As root: the runtime's default capabilities (what an engine image running as root had).
    [ "$who" = 0:0 ] && args=(--rm --network none --read-only --user 0:0
      -v "$dir/sock:$mpath:ro" -v "$dir/attack.sh:/attack.sh:ro" --entrypoint /bin/sh)
    out=$("${PODMAN_RUN[@]}" "${args[@]}" "$IMAGE" /attack.sh 2>&1 | quiet)
    echo "$out" | sed 's/^/    /' >&2
    grep -q "^ls: kvnode.sock $" <<<"$out" || fail "$f as $who sees more than the client socket"
    ! grep -q "TOOK OVER\|STILL RUNNING\|REMOVED\|RENAMED\|WROTE" <<<"$out" || fail "$f as $who: the attack got through"
    if [ "$who" = 0:0 ]; then
      grep -q "^put: .*\(refused\|no tenant\|Handshake\|belongs to no tenant\)" <<<"$out" || fail "root in $f was not refused at the client socket"
    else
      grep -q "^put: stored 1" <<<"$out" || fail "$f as its own uid $uid cannot put"
      # The vLLM tenant's blocks: its own engine hits them, another tenant's engine does not.
      want="0 of 4"
      [ "$uid" = 20001 ] && want="4 of 4"
      grep -q "^get: $want leading pages hit" <<<"$out" || fail "$f as uid $uid: get of the vLLM tenant's blocks is not $want"
    fi
  done
done <"$dir/pods"
[ "$n" = 4 ] || fail "expected 2 engine pods x 2 users, ran $n"

step "the daemon kept serving, the same process, every block"
[ "$(podman inspect --format '{{.State.Running}}' "kvnode-eng-d-$tag")" = true ] || fail "the daemon container stopped"
now=$(as_daemon stats --json --socket "$sock" | python3 -c "import json,sys; print(json.load(sys.stdin)['stats']['pid'])")
[ "$now" = "$pid" ] || fail "another process ($now, was $pid) serves the socket"
setpriv --reuid 20001 --regid 20001 --groups 10001 "$KVNODE" get --socket "$sock" "${keys[@]}" |
  grep -q "^4 of 4 leading pages hit" || fail "the vLLM tenant's blocks are gone"
logs "kvnode-eng-d-$tag" | grep -q "takeover accepted" && fail "the daemon accepted a takeover"
echo "ok: engines (2 engine pods x {own uid, root}: no takeover socket in view, socket dir read-only, daemon pid $pid serving)"
