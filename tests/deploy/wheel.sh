#!/usr/bin/env bash
# The Python package as users install it: `pip wheel clients/python` builds a wheel, a clean
# venv installs it (from the wheel, not the source tree), and the installed package talks to a
# real daemon: register, put, inline get and exists; its data file (the SGLang seam patch) is
# in the install. Needs python3-venv and PyPI (setuptools for the build, msgpack).
source "$(dirname "$0")/lib.sh"
dir=$(scratch wheel)
daemon=
cleanup() { [ -n "$daemon" ] && kill "$daemon" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
step "pip wheel clients/python"
python3 -m venv "$dir/build"
# Built from a copy: setuptools writes kvnode.egg-info (and build/) into the tree it builds,
# and a kvnode.egg-info in the checkout's clients/python would show in every venv that has the
# checkout on its path.
mkdir -p "$dir/src"
cp -r "$ROOT/clients/python/pyproject.toml" "$ROOT/clients/python/kvnode" "$dir/src/"
"$dir/build/bin/pip" wheel -q --no-deps -w "$dir/dist" "$dir/src"
whl=$(ls "$dir"/dist/kvnode-*-py3-none-any.whl) || fail "no kvnode wheel built"
step "install $(basename "$whl") into a clean venv"
python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q "$whl"
"$KVNODE" serve --socket "$dir/kvnode.sock" --dram 16MiB --slab-size 2MiB --no-pin 2>"$dir/daemon.log" &
daemon=$!
wait_socket "$dir/kvnode.sock" || { cat "$dir/daemon.log" >&2; fail "daemon did not start"; }
# Run from / so the source tree cannot shadow the installed package.
(cd / && "$dir/venv/bin/python" - "$dir/kvnode.sock" "$dir/venv" <<'PY'
import hashlib, os, sys
import kvnode, kvnode.sglang, kvnode.vllm.config, kvnode.wire
venv = os.path.realpath(sys.argv[2])
assert os.path.realpath(kvnode.__file__).startswith(venv), f"kvnode imported from {kvnode.__file__}, not the venv"
patch = os.path.join(os.path.dirname(kvnode.sglang.__file__), "sglang-0.5.23-kv-hints.patch")
assert os.path.getsize(patch) > 0, "the SGLang seam patch is not in the wheel"
c = kvnode.Connection(sys.argv[1])
spec = {"model": "wheel-test", "page_size": 64, "segments": [4096]}
ns = c.register(spec)["ns"]
keys = [kvnode.wire.key(hashlib.sha256(bytes([i])).digest()) for i in range(4)]
blocks = [bytes([i]) * 4096 for i in range(4)]
assert c.put(ns, keys, blocks) == ["Stored"] * 4, "put"
assert c.get(ns, keys) == blocks, "get returned other bytes"
assert c.exists(ns, keys) == 4, "exists"
print("wheel: kvnode", getattr(kvnode, "__version__", ""), "from", os.path.dirname(kvnode.__file__), ": put/get/exists ok")
PY
) || fail "the installed wheel does not work against the daemon"
echo "ok: wheel $(basename "$whl")"
