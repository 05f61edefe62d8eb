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
# UCX (the peer transport `ucx`): the daemon links libucp/libucs, so building needs the
# headers' package and running needs its library (libucx0, pulled in by libucx-dev);
# ucx-utils brings `ucx_info`, which lists the transports UCX found (docs/peer-protocol.md).
for pkg in libucx-dev ucx-utils; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
# The etcd client (kvnode-cluster) compiles etcd's .proto files at build time.
command -v protoc >/dev/null || need+=(protobuf-compiler)
if [ "$MODE" = serve ]; then
  if ((${#need[@]})); then
    echo "install-deps: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  exit 0
fi
command -v fio >/dev/null || need+=(fio)
# tests/tests/cluster*.rs start a real etcd (docs/cluster.md) and make TLS certificates.
command -v etcd >/dev/null || need+=(etcd-server)
command -v openssl >/dev/null || need+=(openssl)
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
bash scripts/install-deploy-deps.sh  # podman, runc, mmdebstrap, dpkg-dev, kubernetes-validate venv (tests/deploy)

# Python: the SGLang connector's tests run against the real sglang 0.5.23 wheel in a venv, with
# kvnode's KV-hint seam applied to it (python -m kvnode.sglang patch --apply, reversible).
# `import sglang.srt.mem_cache.hicache_storage` needs torch at module top, and PyPI's Linux torch
# only imports with its CUDA runtime wheels (~3.5 GB download, ~5 min on a cold machine, cached in
# the venv after). The rest is the set found by importing, until nothing was missing, what the
# tests use of SGLang: its host pools (pool_host.mha, pool_host.mamba), StorageMetrics
# (observability.metrics_collector), the request path (io_struct, tokenizer_manager,
# schedule_batch, scheduler, http_server) and both cache controllers (managers.cache_controller,
# hybrid_cache.hybrid_cache_controller, unified_radix_cache). torch is pinned through a
# constraint so torchvision and friends cannot replace it. ninja + g++ + libssl-dev build
# SGLang's native hash extension (cached under ~/.cache/torch_extensions).
VENV="${KVNODE_PY_VENV:-$HOME/.cache/kvnode-sglang-venv}"
PROBE="import sglang.srt.mem_cache.pool_host.mamba, sglang.srt.observability.metrics_collector, \
sglang.srt.managers.scheduler, sglang.srt.managers.tokenizer_manager, sglang.srt.entrypoints.http_server, \
sglang.srt.mem_cache.unified_radix_cache, msgpack, pytest, torch"
if ! "$VENV/bin/python" -c "$PROBE" >/dev/null 2>&1; then
  echo "install-deps: building the Python test venv at $VENV (torch + sglang 0.5.23 --no-deps)" >&2
  python3 -m venv "$VENV"
  pin="$(mktemp)"
  echo "torch==2.14.1" > "$pin"
  "$VENV/bin/pip" install -q torch==2.14.1
  "$VENV/bin/pip" install -q --no-deps sglang==0.5.23
  "$VENV/bin/pip" install -q -c "$pin" numpy orjson psutil pybase64 requests pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp ninja msgpack pytest \
    transformers==5.19.0 tokenizers==0.23.2 zstandard torchvision apache-tvm-ffi==0.1.11 setproctitle \
    fastapi "uvicorn>=0.51" uvloop xxhash prometheus-client python-multipart dill \
    sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai partial_json_parser einops \
    jsonschema xgrammar==0.2.7 soundfile
  rm -f "$pin"
fi
# Always point the venv at this checkout's connector (the venv is shared between checkouts).
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e clients/python
# The seam: idempotent; refuses (exit 2) an sglang other than 0.5.23 or a tree it does not match.
"$VENV/bin/python" -m kvnode.sglang patch --apply

# The vLLM connector's tests run against the real vllm 0.33.0 wheel in a venv of its own.
bash scripts/install-vllm-venv.sh >/dev/null
