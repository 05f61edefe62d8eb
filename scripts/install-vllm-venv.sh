#!/usr/bin/env bash
# The vLLM test venv (clients/python/tests_vllm), built from scripts/locks/vllm.lock; prints its
# python on the last line. Kept for the commands in docs/vllm.md: scripts/py-venv.sh does the work.
set -euo pipefail
exec bash "$(dirname "$0")/py-venv.sh" vllm
