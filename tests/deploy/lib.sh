# Shared helpers of the deploy tests (sourced by tests/deploy/*.sh; run them through
# tests/deploy/run.sh). Every check that fails ends the test with a message: no test skips.
# No pipefail: checks are written `producer | grep -q PATTERN`, and grep -q exits at the first
# match, so a producer still writing gets SIGPIPE; the check is grep's verdict.
set -eu
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
IMAGE=${KVNODE_IMAGE:-localhost/kvnode:$VERSION}
# The packaged build (packaging/build-release.sh), not the workspace's test build.
KVNODE=${KVNODE_BIN:-$ROOT/target/package/release/kvnode}
# podman as it works on this machine: the runc runtime (crun refuses the hybrid cgroup
# layout), descriptor and process limits given explicitly, below the host's hard limits
# (podman's defaults ask for more than the host allows).
NOFILE=$(($(ulimit -Hn) < 65536 ? $(ulimit -Hn) : 65536))
PODMAN_RUN=(podman run --runtime runc --ulimit "nofile=$NOFILE:$NOFILE" --ulimit nproc=4096:4096)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

step() { echo "--- $*" >&2; }

# A fresh directory on a real disk (spill files need O_DIRECT: not tmpfs), removed at exit.
scratch() {
  local d
  d=$(mktemp -d "/var/tmp/kvnode-deploy-$1.XXXXXX")
  echo "$d"
}

# A free loopback TCP port, below the kernel's ephemeral range (clients/python/kvnode_test_ports.py
# says why).
free_port() {
  PYTHONPATH="$(dirname "${BASH_SOURCE[0]}")/../../clients/python" \
    python3 -c 'from kvnode_test_ports import free_port; print(free_port())'
}

# Waits until `kvnode stats` answers on socket $1 and says its spill index is rebuilt (up to
# $2 seconds, default 20).
wait_socket() {
  local i
  for ((i = 0; i < ${2:-20} * 10; i++)); do
    # Answering, and its spill index rebuilt (a daemon serves from DRAM while it recovers).
    "$KVNODE" stats --json --socket "$1" 2>/dev/null |
      python3 -c "import json,sys; sys.exit(1 if json.load(sys.stdin)['stats'].get('spill_recovering') else 0)" \
        2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# One field of `kvnode stats --json` on socket $1: a Python expression over `s` ($2).
stat_of() {
  "$KVNODE" stats --json --socket "$1" | python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print($2)"
}

# GET http://$1 (host:port/path): the body on stdout, fails on a non-200 answer.
http_get() {
  python3 -c 'import sys,urllib.request; r=urllib.request.urlopen("http://"+sys.argv[1], timeout=5); assert r.status==200, r.status; sys.stdout.write(r.read().decode())' "$1"
}
