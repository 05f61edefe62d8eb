#!/usr/bin/env bash
# Installs the system packages kvnode's build, tests and benchmarks need (Debian 12).
# Idempotent: does nothing when everything is present.
set -euo pipefail
need=()
command -v cargo >/dev/null || { echo "install-deps: cargo (Rust >= 1.95) is required and missing" >&2; exit 1; }
command -v cc >/dev/null || need+=(gcc)
command -v fio >/dev/null || need+=(fio)
command -v iperf3 >/dev/null || need+=(iperf3)
if ((${#need[@]})); then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "install-deps: installing ${need[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
