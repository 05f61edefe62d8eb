#!/usr/bin/env bash
# Installs what kvnode needs on Debian 12. Idempotent: does nothing when everything is present.
#   scripts/install-deps.sh serve   what building and running the daemon needs (a C compiler)
#   scripts/install-deps.sh [test]  everything the test suite and benchmarks need
set -euo pipefail
MODE=${1:-test}
case "$MODE" in serve|test) ;; *) echo "usage: $0 [serve|test]" >&2; exit 2 ;; esac
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
need=()
command -v cargo >/dev/null || { echo "install-deps: cargo (Rust >= 1.95) is required and missing" >&2; exit 1; }
command -v cc >/dev/null || need+=(gcc)
if [ "$MODE" = serve ]; then
  if ((${#need[@]})); then
    echo "install-deps: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  exit 0
fi
command -v fio >/dev/null || need+=(fio)
command -v iperf3 >/dev/null || need+=(iperf3)
# kvtrace: clang compiles the BPF programs, bpftool generates vmlinux.h, libbpf (vendored by
# libbpf-sys) links against the system libelf and zlib found through pkg-config; asm/ headers
# come from linux-libc-dev.
command -v clang >/dev/null || need+=(clang)
command -v bpftool >/dev/null || need+=(bpftool)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v make >/dev/null || need+=(make)
for pkg in libelf-dev zlib1g-dev linux-libc-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
command -v c++ >/dev/null || need+=(g++)
# SGLang JIT-compiles its page-hash extension against libcrypto on first use.
dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
if ((${#need[@]})); then
  echo "install-deps: installing ${need[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Python: the SGLang connector's tests run against the real sglang 0.5.23 wheel in a venv.
# `import sglang.srt.mem_cache.hicache_storage` needs torch at module top, and PyPI's Linux torch
# only imports with its CUDA runtime wheels (~3.5 GB download, ~5 min on a cold machine, cached in
# the venv after). The rest is the minimal set found by importing hicache_storage and
# mem_cache.utils (get_hash_str) until nothing was missing; ninja + g++ + libssl-dev build
# SGLang's native hash extension (cached under ~/.cache/torch_extensions).
VENV="${KVNODE_PY_VENV:-$HOME/.cache/kvnode-sglang-venv}"
if ! "$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage, msgpack, pytest" >/dev/null 2>&1; then
  echo "install-deps: building the Python test venv at $VENV (torch + sglang 0.5.23 --no-deps)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.14.1
  "$VENV/bin/pip" install -q --no-deps sglang==0.5.23
  "$VENV/bin/pip" install -q numpy orjson psutil pybase64 requests pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp ninja msgpack pytest
fi
# Always point the venv at this checkout's connector (the venv is shared between checkouts).
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e clients/python

# The vLLM connector's tests run against the real vllm 0.33.0 wheel in a venv of its own.
bash scripts/install-vllm-venv.sh >/dev/null
