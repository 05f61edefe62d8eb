#!/usr/bin/env bash
# Builds (once) a cached virtualenv with the real vllm==0.33.0 wheel importable on a CPU-only
# machine, for clients/python/tests_vllm. Idempotent: a venv whose stamp matches is reused in
# about a tenth of a second. Prints the venv's python path on its last line.
#
#   scripts/install-vllm-venv.sh            # -> ~/.cache/kvnode-vllm-venv
#   KVNODE_VLLM_VENV=/path scripts/install-vllm-venv.sh
#
# Why not `pip install vllm==0.33.0`: vllm pins torch==2.14.0 (a CUDA 13 build on PyPI: no CPU
# build is published there for x86_64), plus flashinfer, tilelang, cutlass-dsl, torchaudio,
# torchvision and ~80 more. The scheduler side of vLLM needs none of the GPU kernels, so this
# installs vllm and torch with --no-deps, only the CUDA runtime libraries that torch's shared
# objects are linked against (torch does not import without them, even with no GPU), and the
# pure-Python packages vllm imports on the scheduler path. Measured numbers: docs/vllm.md.
set -euo pipefail

VENV="${KVNODE_VLLM_VENV:-$HOME/.cache/kvnode-vllm-venv}"
PY="${PYTHON:-python3}"
STAMP_TEXT="vllm==0.33.0 torch==2.14.0 kvnode-vllm-venv v1"

if [[ -f "$VENV/.kvnode-stamp" && "$(cat "$VENV/.kvnode-stamp")" == "$STAMP_TEXT" ]] \
   && "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('vllm') and u.find_spec('torch')" \
      >/dev/null 2>&1; then
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# 1. Big wheels, no dependency resolution (it would pull flashinfer, triton, the whole CUDA toolkit).
#    The nvidia-* set is exactly the sonames in torch/lib/*.so's DT_NEEDED (libcudart, cublas,
#    cublasLt, cufft, cufile, cupti, curand, cusparse, cusparseLt, cudnn, nccl, nvrtc, nvshmem)
#    at the versions torch 2.14.0's metadata pins.
"${PIP[@]}" --no-deps \
  torch==2.14.0 vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
  'nvidia-cuda-runtime==13.0.96.*' 'nvidia-cublas==13.1.1.3.*' 'nvidia-cuda-nvrtc==13.0.88.*' \
  'nvidia-cufft==12.0.0.61.*' 'nvidia-nvjitlink>=13.0.88,<14' 'nvidia-cufile==1.15.1.6.*' \
  'nvidia-cuda-cupti==13.0.85.*' 'nvidia-curand==10.4.0.35.*' 'nvidia-cusparse==12.6.3.3.*' \
  'nvidia-cudnn-cu13==9.24.0.43' 'nvidia-cusparselt-cu13==0.8.1' 'nvidia-nccl-cu13==2.30.7' \
  'nvidia-nvshmem-cu13==3.4.5'

# 2. Pure-Python (or small binary) packages imported on vLLM's config/scheduler/connector path,
#    within vllm 0.33.0's own version bounds. None of them depends on torch.
"${PIP[@]}" \
  'filelock>=3.20.3' 'typing_extensions>=4.10' 'sympy>=1.13.3' 'networkx>=2.5.1' jinja2 'fsspec>=0.8.5' \
  'setuptools>=78.1.1,<81' numpy regex cachetools psutil cbor2 'pyzmq>=25' msgspec cloudpickle \
  'pydantic>=2.12' 'transformers>=5.16.1,<5.21' 'tokenizers>=0.23.2' 'huggingface_hub>=1.31' \
  'aiohttp>=3.14.4' 'requests>=2.33' 'openai>=2.25' openai-harmony 'pillow>=13' pybase64 uvloop \
  py-cpuinfo 'prometheus_client>=0.18' 'fastapi>=0.133,<0.137' partial-json-parser \
  'llguidance>=1.7,<1.8' blake3 pyyaml tqdm \
  'msgpack>=1.0' 'pytest>=7'

"$VENV/bin/python" - <<'PY'
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
assert vllm.__version__.startswith("0.33.0"), vllm.__version__
assert torch.__version__.startswith("2.14.0"), torch.__version__
PY
echo "$STAMP_TEXT" > "$VENV/.kvnode-stamp"
echo "kvnode-vllm-venv: built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV/bin/python"
